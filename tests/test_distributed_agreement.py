"""qd.attention refuses, on every rank, masks and score_mods that differ in content across
ranks, and gives the single-process answer for shards of any memory layout, handing
torch.distributed only contiguous tensors. Spawned gloo worlds of 2 and 3
ranks, as tests/test_distributed.py; the cases are in tests/dist_agreement.py, and the
layout cases reuse dist_cases.run_case with ``memory=``.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

import qkv
from catalogue import LAYOUTS as MEMORY
from dist_agreement import differing, equal, watch_wire
from dist_cases import run_case
from dist_testing import finish, init_worker, run_world
from qkv.distributed import content

WORLDS = [2, 3]
LAYOUTS = ["zigzag", "contiguous"]
MEMORY_CASES = ["causal", "document", "GQA", "learnable table in transposed storage"]


def _world(rank: int, W: int, port: int, out: str) -> None:
    init_worker(rank, W, port)
    results: dict[str, Any] = {}

    def attempt(key: str, fn: Any, *args: Any, **kw: Any) -> None:
        try:
            results[key] = fn(*args, **kw)
        except Exception:  # a failure of one case is reported by its own test
            results[key] = [traceback.format_exc()]

    for layout in LAYOUTS:
        attempt(f"{layout}/differing", differing, rank, W, layout)
        attempt(f"{layout}/equal", equal, rank, W, layout)
        for name in MEMORY_CASES:
            for memory in MEMORY:
                with watch_wire() as bad:
                    attempt(
                        f"{layout}/{name}/{memory}", run_case, rank, W, layout, name, memory=memory
                    )
                results[f"{layout}/{name}/{memory}"] += [f"not contiguous: {b}" for b in bad]
    finish(out, rank, results)


# The world of 3 (uneven shards; ~15 s) is extended (make test-all); 2 ranks in the default run.
@pytest.fixture(
    scope="module",
    params=[pytest.param(w, marks=[pytest.mark.extended]) if w == 3 else w for w in WORLDS],
    ids=lambda w: f"W{w}",
)
def world(request: pytest.FixtureRequest) -> tuple[int, list[Any]]:
    return request.param, run_world(request.param, _world)


def _failures(world: tuple[int, list[Any]], key: str) -> list[str]:
    _, results = world
    fails = []
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} wrote no results (it died or the world hung)"
        fails += [f"rank {r}: {f}" for f in res[key]]
    return fails


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["differing", "equal"])
def test_mask_content_agreement(world: tuple[int, list[Any]], layout: str, case: str) -> None:
    fails = _failures(world, f"{layout}/{case}")
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("case", MEMORY_CASES)
def test_any_memory_layout(
    world: tuple[int, list[Any]], layout: str, case: str, memory: str
) -> None:
    """Output, lse and every gradient as the single-process call and the float64 oracle
    (dist_cases.run_case), with q, k, v and the upstream gradient in ``memory``; nothing
    non-contiguous handed to torch.distributed."""
    fails = _failures(world, f"{layout}/{case}/{memory}")
    assert not fails, "\n".join(fails)


# ------------------------------------------------------------- in this process: checksums


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])  # "cuda": the on-device hash, here
def test_checksum_sees_content(device_type: str) -> None:
    ids = torch.arange(1000) // 100

    def cs(t: torch.Tensor) -> int:
        return content.checksum(t, device_type)

    assert cs(ids) == cs(ids.clone()) == cs(ids.to(torch.int32))  # ints: by value
    swapped = ids.clone()
    swapped[[10, 990]] = swapped[[990, 10]]
    assert cs(swapped) != cs(ids)
    one = ids.clone()
    one[500] += 1
    assert cs(one) != cs(ids)
    assert cs(ids.view(10, 100)) != cs(ids)  # the shape counts
    m = torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) < 0.5
    flipped = m.clone()
    flipped[63, 63] = ~flipped[63, 63]
    assert cs(m) == cs(m.clone()) and cs(flipped) != cs(m)
    assert cs(m.t()) == cs(m.t().contiguous())  # by value, whatever the strides
    x = torch.randn(3, 5)
    assert cs(x) != cs(x.double()) and cs(x) != cs(x + 1e-7 * x.abs().max())


def test_collect_names_what_a_mask_holds() -> None:
    ids = torch.zeros(10, dtype=torch.int64)
    t = torch.ones(4)

    def mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return t[q % 4] > 0

    items, users = content.collect(
        qkv.and_masks(qkv.causal, qkv.document(ids), mod),
        qkv.alibi(qkv.alibi_slopes(2)),
    )
    whats = [w for w, _, _ in items]
    assert whats == [
        "the document ids of the mask qkv.document(<10 ids>)",
        "tensor 0 [4] that the mask_mod mod closes over",
        "the slopes of the score_mod qkv.alibi(<2 slopes>)",
    ]
    assert users == ["mask_mod mod"]
    assert content.collect(qkv.causal, qkv.softcap(2.0)) == ([], [])

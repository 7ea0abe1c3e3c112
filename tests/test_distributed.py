"""qkv.distributed: exact attention over a sequence split across processes.

The plan and the layouts are tested in this process; ``qd.attention`` runs in spawned worlds
of 2, 3 and 4 ranks (gloo on 127.0.0.1, one thread each), each world started once and
running every case of ``dist_cases.py`` and ``dist_more.py`` for both layouts; the tests
below read its results. No process outlives its world (``dist_testing.run_world``).
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

import qkv
import qkv.distributed as qd
from dist_cases import CASES, run_case
from dist_more import errors, subgroup, traffic, train
from dist_testing import (
    abort_after_results,
    abort_before_results,
    abort_in_setup_once,
    finish,
    init_worker,
    run_world,
)

WORLDS = [2, 3, 4]
LAYOUTS = ["zigzag", "contiguous"]
EXTRA = ["traffic window", "traffic causal", "errors", "trains", "subgroup"]


def _world(rank: int, W: int, port: int, out: str) -> None:
    init_worker(rank, W, port)
    results: dict[str, Any] = {}

    def attempt(key: str, fn: Any, *args: Any) -> None:
        try:
            results[key] = fn(*args)
        except Exception:  # a failure of one case is reported by its own test
            results[key] = [traceback.format_exc()]

    for layout in LAYOUTS:
        for name in CASES:
            attempt(f"{layout}/{name}", run_case, rank, W, layout, name)
        attempt(f"{layout}/traffic window", traffic, rank, W, layout, "window")
        attempt(f"{layout}/traffic causal", traffic, rank, W, layout, "causal")
        attempt(f"{layout}/errors", errors, rank, W, layout)
        attempt(f"{layout}/trains", train, rank, W, layout)
        attempt(f"{layout}/subgroup", subgroup, rank, W, layout)
    finish(out, rank, results)


# A world of 4 (~25 s to start and run) is extended (make test-all): 2 and 3 ranks cover even
# and uneven splits in the default run.
@pytest.fixture(
    scope="module",
    params=[pytest.param(w, marks=[pytest.mark.extended]) if w == 4 else w for w in WORLDS],
    ids=lambda w: f"W{w}",
)
def world(request: pytest.FixtureRequest) -> tuple[int, list[Any]]:
    return request.param, run_world(request.param, _world)


def _failures(world: tuple[int, list[Any]], key: str) -> list[str]:
    _, results = world
    fails = []
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} wrote no results"
        fails += [f"rank {r}: {f}" for f in res[key]]
    return fails


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", [*CASES, *EXTRA])
def test_matches_single_process(world: tuple[int, list[Any]], layout: str, case: str) -> None:
    """Output, lse and every gradient equal the single-process call's slices (and the
    float64 oracle's, by error ratio); traffic equals the plan; errors; training."""
    fails = _failures(world, f"{layout}/{case}")
    assert not fails, "\n".join(fails)


# ------------------------------------------------------------ in this process: the plan


def test_layouts_cover_the_sequence_once() -> None:
    for kind in LAYOUTS:
        for W in (1, 2, 3, 4, 5):
            for L in (1, 2, 7, 10, 53, 64):
                lay = qd.Layout(kind, W, L)
                x = torch.arange(L).view(1, 1, L, 1)
                parts = [lay.take(x, r) for r in range(W)]
                assert [p.shape[2] for p in parts] == list(lay.lengths)
                assert torch.equal(lay.assemble(parts), x)
                got = torch.cat([lay.positions(r) for r in range(W)]).sort().values
                assert torch.equal(got, torch.arange(L))
    z = qd.Layout("zigzag", 2, 10)
    assert z.positions(0).tolist() == [0, 1, 2, 9] and z.positions(1).tolist() == [3, 4, 5, 6, 7, 8]


def test_zigzag_balances_causal_work() -> None:
    z = qd.plan(1, 4, 4096, 64, mask=qkv.causal, world_size=4, layout="zigzag")
    c = qd.plan(1, 4, 4096, 64, mask=qkv.causal, world_size=4, layout="contiguous")
    assert z.imbalance < 1.1 < 3.0 < c.imbalance
    # Causal in the contiguous layout: rank r receives only from earlier ranks.
    for rp in c.ranks:
        assert all(st.recv_from < rp.rank for st in rp.steps[1:] if st.recv_chunks)
    assert c.ranks[0].bytes_received == 0
    total = 4 * 1 * 4 * 4096 * 4096 * 64 / 2  # 4·B·H·L²·D halved for causal (D = Dv)
    assert sum(r.flops for r in z.ranks) == pytest.approx(total, rel=0.05)


def test_window_plan_names_neighbours_only() -> None:
    for layout in LAYOUTS:
        p = qd.plan(1, 2, 8192, 64, mask=qkv.sliding_window(256), world_size=4, layout=layout)
        for rp in p.ranks:
            assert rp.peers and all(abs(x - rp.rank) == 1 for x in rp.peers), rp.peers
            assert rp.bytes_received < p.allgather_bytes / 2
        text = str(p)
        assert "imbalance" in text and "rank 3" in text and "peers" in text
    # Only the window's keys move, not whole chunks: contiguous rank r > 0 receives the last
    # 256 keys of rank r - 1 (K and V, 2 heads of 64 features, float32).
    p = qd.plan(1, 2, 8192, 64, mask=qkv.sliding_window(256), world_size=4, layout="contiguous")
    assert [rp.bytes_received for rp in p.ranks] == [0] + [256 * 2 * 128 * 4] * 3
    assert "[1792, 2048)" in str(p)


def test_documents_reach_only_ranks_that_share_them() -> None:
    L = 1000
    ids = torch.zeros(L, dtype=torch.int64)
    ids[500:] = 1  # two documents: [0, 500) and [500, 1000)
    p = qd.plan(1, 1, L, 16, mask=qkv.document(ids), world_size=4, layout="contiguous")
    # contiguous chunks of 250: ranks 0, 1 hold document 0, ranks 2, 3 document 1
    assert [rp.peers for rp in p.ranks] == [(1,), (0,), (3,), (2,)]


def test_no_mask_plan_is_an_all_gather() -> None:
    p = qd.plan(2, 4, 100, 8, world_size=3, layout="zigzag", Hkv=2, Dv=4)
    for rp in p.ranks:
        rest = 100 - rp.rows
        assert rp.bytes_received == rest * 2 * 2 * (8 + 4) * 4
    assert p.imbalance < 1.1


def test_plan_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="layout"):
        qd.plan(1, 1, 10, 8, world_size=2, layout="ring")
    with pytest.raises(ValueError, match="world_size"):
        qd.plan(1, 1, 10, 8, world_size=0)


def test_uninitialised_group_is_a_clear_error() -> None:
    assert not dist.is_initialized()
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        qd.attention(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        qd.shard(q)


def test_a_rank_that_dies_is_reported_with_its_log() -> None:
    """A world's harness: a rank killed by a signal (as gloo aborts) after its setup fails the
    world with what the rank printed, its Python stack included; after every rank wrote its
    results, the same death (a teardown) is a warning and the results stand."""
    with pytest.raises(RuntimeError) as e:
        run_world(1, abort_before_results, timeout=120)
    assert "SIGABRT" in str(e.value) and "rank about to abort" in str(e.value)
    assert "Fatal Python error: Aborted" in str(e.value)
    with pytest.warns(UserWarning, match="every rank wrote its results"):
        assert run_world(1, abort_after_results, timeout=120) == [{"rank": 0}]


def test_a_world_that_fails_in_its_setup_is_started_again(tmp_path: Any) -> None:
    """A rank that dies before every rank is ready (gloo aborts there at times, before any
    qkv code runs): the world is started again, once, with a warning."""
    flag = str(tmp_path / "aborted once")
    with pytest.warns(UserWarning, match="failed in torch.distributed's setup"):
        assert run_world(1, abort_in_setup_once, flag, timeout=120) == [{"attempt": 2}]


def test_import_qkv_stays_light() -> None:
    import subprocess
    import sys

    code = "import sys, qkv; print('qkv.distributed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

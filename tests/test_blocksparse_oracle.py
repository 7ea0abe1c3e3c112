"""The block-sparse backend against the oracle: the core's randomized matrix (sampled so that
every value of every factor appears), and block-level edge cases (block sizes that divide
nothing, all-full / all-partial / all-empty grids, fully masked rows and query blocks, a
block mask reused across calls, float16 / float64, huge logits, empty problems).

Schedules and memory bounds are in test_blocksparse_schedules.py, gradients through
score_mod-captured tensors and the lse in test_blocksparse_gradients.py, dropout in
test_blocksparse_dropout.py.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import torch

import qkv
from catalogue import (
    DTYPES,
    HEAD_DIMS,
    HEADS,
    LENGTHS,
    OTHER_DTYPES,
    SHAPES,
    Shape,
    make_mask,
    make_qkv,
    make_score,
)
from conftest import cuda
from qkv_testing import assert_matches_oracle, compare_to_oracle

blocksparse = functools.partial(qkv.attention, backend="blocksparse")
with_lse = functools.partial(qkv.attention, backend="blocksparse", return_lse=True)

TILES = SHAPES["tiles"]  # [2, 4|2, 70|90, 24|16]: no block size of 16 divides the lengths

# ------------------------------------------------------------------------ the oracle matrix

# The catalogue's entries (catalogue.MASKS / SCORES say what each is for).
MASKS = [
    "none",
    "causal",
    "window",
    "window2",
    "document",
    "document_unsorted",
    "padding",
    "prefix_lm",
    "and",
    "or",
    "bool",
    "dilated",
    "head_dependent",
    "dead_rows",
]
SCORES = ["none", "alibi", "softcap", "relative", "bias_batch", "closure"]
BLOCKS = [None, 16, (32, 48), 100]


def _cases() -> list[dict[str, Any]]:
    """Every value of every factor at least once, the other factors drawn at random (seeded)."""
    rng = random.Random(1234)
    factors = {
        "Lq": LENGTHS,
        "Lk": LENGTHS,
        "D": HEAD_DIMS,
        "heads": HEADS,
        "mask": MASKS,
        "score": SCORES,
        "dtype": DTYPES,
        "block": BLOCKS,
    }
    cases = []
    for name, values in factors.items():
        for val in values:
            c = {k: rng.choice(v) for k, v in factors.items()}
            c[name] = val
            if c["Lq"] == c["Lk"] and rng.random() < 0.7:  # mostly Lq != Lk
                c["Lk"] = rng.choice([x for x in LENGTHS if x != c["Lq"]])
            c["Dv"] = c["D"] if rng.random() < 0.5 else rng.choice([5, 33, 64, 96])
            big = max(c["Lq"], c["Lk"]) > 300
            c["B"] = 1 if big else rng.choice([1, 2])
            if big and c["heads"][0] > 4:  # keep the float64 oracle's n² matrices small
                c["heads"] = (4, rng.choice([1, 2, 4]))
            c["seed"] = rng.randrange(1 << 30)
            cases.append(c)
    return cases


def _id(c: dict[str, Any]) -> str:
    dt = "bf16" if c["dtype"] == torch.bfloat16 else "fp32"
    hq, hkv = c["heads"]
    return (
        f"{c['mask']}-{c['score']}-{dt}-L{c['Lq']}x{c['Lk']}-D{c['D']}v{c['Dv']}"
        f"-H{hq}/{hkv}-B{c['B']}-blk{c['block']}"
    )


@pytest.mark.parametrize("c", _cases(), ids=_id)
def test_oracle_matrix(c):
    gen = torch.Generator().manual_seed(c["seed"])
    (Hq, Hkv), Lq, Lk = c["heads"], c["Lq"], c["Lk"]
    shape = Shape(c["B"], Hq, Hkv, Lq, Lk, c["D"], c["Dv"])
    q, k, v = make_qkv(shape, dtype=c["dtype"], gen=gen)
    mask = make_mask(c["mask"], shape, gen)
    score_mod, params = make_score(c["score"], shape, gen)
    if c["block"] is not None and mask is not None:
        mask = qkv.block_mask(mask, shape.B, Hq, Lq, Lk, block_size=c["block"])
    res = compare_to_oracle(
        with_lse, q, k, v, mask=mask, score_mod=score_mod, extra_params=params, seed=c["seed"]
    )
    assert_matches_oracle(res)


# ------------------------------------------------------------------------ block-level cases


@pytest.mark.parametrize("bs", [1, 7, 16, (9, 32), 64, 200])
@pytest.mark.parametrize("mask", ["causal", "window", "dilated", "document"])
def test_block_sizes_that_do_not_divide_the_lengths(check, bs, mask):
    q, k, v = make_qkv(TILES)
    m = qkv.block_mask(make_mask(mask, TILES, 3), 2, 4, 70, 90, block_size=bs)
    check(with_lse, q, k, v, mask=m)


@pytest.mark.parametrize(
    "mod",
    [
        lambda b, h, q, k: q >= 0,  # every tile full
        lambda b, h, q, k: (q + k) % 2 == 0,  # every tile partial
    ],
    ids=["all_full", "all_partial"],
)
@pytest.mark.parametrize("score", ["none", "relative"])
def test_all_full_and_all_partial(check, mod, score):
    q, k, v = make_qkv(TILES)
    m = qkv.block_mask(mod, None, None, 70, 90, block_size=16)
    sm, params = make_score(score, TILES, 0)
    check(with_lse, q, k, v, mask=m, score_mod=sm, extra_params=params)


@pytest.mark.parametrize("score", ["none", "softcap"])
def test_all_empty_gives_zeros_and_minus_inf(score):
    q, k, v = make_qkv(TILES, requires_grad=True)
    m = qkv.block_mask(lambda b, h, i, j: i < 0, None, None, 70, 90, block_size=16)
    out, lse = with_lse(q, k, v, mask=m, score_mod=make_score(score, TILES)[0])
    assert torch.equal(out, torch.zeros_like(out))
    assert bool(torch.isneginf(lse).all())
    (out.sum() + out.square().sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("score", ["none", "alibi"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_and_query_blocks(check, score, dtype):
    """Rows 0-39 see nothing (query blocks 0-4 of 8 are entirely masked), batch element 1
    has no keys at all (padding length 0): output 0, lse -inf, zero gradients, no NaN."""
    q, k, v = make_qkv(TILES, dtype=dtype)
    pad = qkv.padding(torch.tensor([90, 0]))
    late = qkv.and_masks(pad, lambda b, h, i, j: (i >= 40) & (j <= i))
    m = qkv.block_mask(late, 2, 4, 70, 90, block_size=8)
    sm, params = make_score(score, TILES, 0)
    check(with_lse, q, k, v, mask=m, score_mod=sm, extra_params=params)
    out, lse = with_lse(q, k, v, mask=m, score_mod=sm)
    assert torch.equal(out[:, :, :40], torch.zeros_like(out[:, :, :40]))
    assert bool(torch.isneginf(lse[:, :, :40]).all()) and bool(torch.isneginf(lse[1]).all())


def test_block_mask_reused_across_calls_and_layers():
    calls = []

    def dilated(b, h, q, k):
        calls.append(1)
        return (q - k) % 3 == 0

    bm = qkv.block_mask(dilated, 2, 4, 70, 90, block_size=16)
    planned = len(calls)
    rows = bm.rows()
    for seed in range(3):  # three "layers" with different activations
        q, k, v = make_qkv(TILES, gen=seed)
        got = blocksparse(q, k, v, mask=bm)
        want, _ = qkv.reference.attention(q, k, v, mask=dilated)
        torch.testing.assert_close(got, want)
    assert bm.rows() is rows  # the schedule is built once
    # After planning, only partial tiles are evaluated again (no re-planning of the grid).
    n_partial = int((bm.states == 1).any(0).any(0).sum())
    assert len(calls) - planned <= 3 * n_partial


@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
@pytest.mark.parametrize("mask", ["none", "causal", "window", "document", "prefix_lm", "dilated"])
def test_float16_and_float64(check, dtype, mask):
    shape = TILES.replace(Lq=300, Lk=260, D=32, Dv=16)
    q, k, v = make_qkv(shape, dtype=dtype)
    m = make_mask(mask, shape, 2)
    check(with_lse, q, k, v, mask=m)
    check(with_lse, q, k, v, mask=m, score_mod=qkv.softcap(5.0))


def test_huge_logits_never_overflow(check):
    q, k, v = make_qkv(TILES)
    check(
        with_lse, q * 100, k * 100, v, mask=qkv.block_mask(qkv.causal, 2, 4, 70, 90, block_size=16)
    )
    check(with_lse, q * 100, k * 100, v, mask=qkv.causal, score_mod=qkv.softcap(1e4))


def test_empty_and_keyless_problems():
    q, k, v = make_qkv(TILES.replace(Lq=0))
    out, lse = with_lse(q, k, v, mask=qkv.causal)
    assert out.shape == (2, 4, 0, 16) and lse.shape == (2, 4, 0)
    q, k, v = make_qkv(TILES.replace(Lk=0), requires_grad=True)
    out, lse = with_lse(q, k, v)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_unbatched_inputs():
    x = torch.randn(50, 16)
    out, _ = qkv.reference.attention(x, x, x, mask=qkv.causal)
    torch.testing.assert_close(blocksparse(x, x, x, mask=qkv.sliding_window(60)), out)
    x3 = torch.randn(3, 50, 16)
    out3, _ = qkv.reference.attention(x3, x3, x3, mask=qkv.sliding_window(4))
    torch.testing.assert_close(blocksparse(x3, x3, x3, mask=qkv.sliding_window(4)), out3)


# ------------------------------------------------------------------------------- CUDA


@cuda
@pytest.mark.parametrize("mask", ["causal", "window", "dilated", "dead_rows"])
@pytest.mark.parametrize("score", ["none", "relative"])
def test_cuda_matches_oracle(check, mask, score):
    shape = TILES.replace(Lq=300, Lk=260)
    q, k, v = make_qkv(shape, device="cuda")
    m = make_mask(mask, shape, 0, device="cuda")
    sm, params = make_score(score, shape, 1, device="cuda")
    check(with_lse, q, k, v, mask=m, score_mod=sm, extra_params=params)


@cuda
def test_cuda_block_mask_reuse_and_bf16(check):
    q, k, v = make_qkv(TILES, dtype=torch.bfloat16, device="cuda")
    bm = qkv.block_mask(qkv.sliding_window(16), 2, 4, 70, 90, block_size=16, device="cuda")
    check(with_lse, q, k, v, mask=bm)
    check(with_lse, q, k, v, mask=bm)

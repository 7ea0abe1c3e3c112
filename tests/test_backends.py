"""Every backend against the float64 oracle on a randomized matrix of problems.

The matrix covers each value of each axis (batch, head grouping, lengths with Lq != Lk, head
dims with Dv != D, every built-in mask and score mod, bool tensors, arbitrary mask_mods, fully
masked rows, fp32 and bf16) by cycling every axis at a different stride, so the cases mix the
axes without running the full product. Each case checks the output, the lse where the
backend returns one, and the gradients of q, k, v and of any bias / score_mod table, with a
random upstream gradient.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import qkv
from qkv.planner import BACKENDS
from qkv_testing import assert_matches_oracle, compare_to_oracle

BATCH = [1, 2]
HEADS = [(1, 1), (4, 4), (8, 2), (8, 1)]
LENGTHS = [(1, 7), (7, 113), (113, 256), (256, 7), (1025, 113), (113, 1025), (7, 1), (256, 256)]
DIMS = [(8, 8), (59, 59), (64, 32), (111, 111), (128, 128), (64, 64), (59, 111)]
MASKS = [
    "none",
    "causal",
    "window",
    "window2",
    "document",
    "padding",
    "prefix_lm",
    "and",
    "or",
    "bool",
    "prefix_mod",
    "dilated",
    "head_dependent",
    "rows_masked",
]
SCORES = ["none", "bias", "alibi", "softcap", "relative", "closure"]
DTYPES = [torch.float32, torch.bfloat16]


@dataclass
class Case:
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    mask: str
    score: str
    dtype: torch.dtype

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (
            f"B{self.B}-H{self.Hq}x{self.Hkv}-L{self.Lq}x{self.Lk}-D{self.D}x{self.Dv}-"
            f"{self.mask}-{self.score}-{dt}"
        )


def _cases(n: int) -> list[Case]:
    axes = [BATCH, HEADS, LENGTHS, DIMS, MASKS, SCORES, DTYPES]
    out = []
    for i in range(n):
        # Every axis cycles through its values; the axes have different lengths, so the
        # combinations keep changing while every value of every axis shows up.
        pick = [ax[(i + 3 * j) % len(ax)] for j, ax in enumerate(axes)]
        B, (Hq, Hkv), (Lq, Lk), (D, Dv), mask, score, dtype = pick
        if Lq * Lk > 100_000:
            B = 1  # keep the float64 oracle of the long cases cheap
        out.append(Case(B, Hq, Hkv, Lq, Lk, D, Dv, mask, score, dtype))
    return out


def _coverage_cases() -> list[Case]:
    cases = _cases(len(MASKS) * len(SCORES))
    # plus every mask on one small GQA shape, with and without a score mod
    small = [
        Case(2, 4, 2, 7, 13, 16, 16, m, s, torch.float32) for m in MASKS for s in ("none", "alibi")
    ]
    return cases + small


CASES = _coverage_cases()


def make_mask(name: str, c: Case, gen: torch.Generator) -> Any:
    n = max(c.Lq, c.Lk)
    if name == "none":
        return None
    if name == "causal":
        return qkv.causal
    if name == "window":
        return qkv.sliding_window(5)
    if name == "window2":
        return qkv.sliding_window(3, 2)
    if name == "document":
        ids = torch.sort(torch.randint(0, 4, (n,), generator=gen)).values
        return qkv.document(ids)
    if name == "padding":
        lengths = torch.randint(0, c.Lk + 1, (c.B,), generator=gen)
        lengths[0] = 0  # a batch element with no keys at all: every row fully masked
        return qkv.padding(lengths)
    if name == "prefix_lm":
        return qkv.prefix_lm(3)
    if name == "and":
        ids = torch.arange(n) // 5
        return qkv.and_masks(qkv.causal, qkv.document(ids))
    if name == "or":
        return qkv.or_masks(qkv.sliding_window(2), lambda b, h, q, k: k == 0)
    if name == "bool":
        return torch.rand(c.Lq, c.Lk, generator=gen) > 0.3
    if name == "prefix_mod":
        return lambda b, h, q, k: k < 5
    if name == "dilated":
        return lambda b, h, q, k: (q - k) % 3 == 0
    if name == "head_dependent":
        return lambda b, h, q, k: k <= q + h
    if name == "rows_masked":
        m = torch.rand(c.B, 1, c.Lq, c.Lk, generator=gen) > 0.5
        m[:, :, ::3] = False  # every third query row sees nothing
        return m
    raise AssertionError(name)


def make_score(name: str, c: Case, gen: torch.Generator) -> tuple[Any, tuple[torch.Tensor, ...]]:
    if name == "none":
        return None, ()
    if name == "bias":
        return torch.randn(1, c.Hq, c.Lq, c.Lk, generator=gen), ()
    if name == "alibi":
        return qkv.alibi(qkv.alibi_slopes(c.Hq)), ()
    if name == "softcap":
        return qkv.softcap(2.0), ()
    if name == "relative":
        table = torch.randn(2 * 4 + 1, c.Hq, generator=gen).requires_grad_()
        return qkv.relative_bias(table, 4), (table,)
    if name == "closure":
        w = torch.randn(c.Hq, generator=gen).requires_grad_()

        def head_scale(score, b, h, q, k):
            return score * torch.sigmoid(w)[h] * 2

        return head_scale, (w,)
    raise AssertionError(name)


def run_case(case: Case, backend: str) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    q = torch.randn(case.B, case.Hq, case.Lq, case.D, generator=gen).to(case.dtype)
    k = torch.randn(case.B, case.Hkv, case.Lk, case.D, generator=gen).to(case.dtype)
    v = torch.randn(case.B, case.Hkv, case.Lk, case.Dv, generator=gen).to(case.dtype)
    mask = make_mask(case.mask, case, gen)
    score_mod, params = make_score(case.score, case, gen)
    want_lse = backend != "sdpa"
    fn = functools.partial(qkv.attention, backend=backend, return_lse=want_lse)
    probe = qkv._problem.validate(
        q, k, v, mask=mask, score_mod=score_mod, return_lse=want_lse
    )  # what the backend would see
    why = BACKENDS[backend].rejects(probe) if backend != "auto" else None
    if why is not None:
        with pytest.raises(ValueError, match="cannot compute this problem"):
            fn(q, k, v, mask=mask, score_mod=score_mod)
        return
    assert_matches_oracle(
        compare_to_oracle(fn, q, k, v, mask=mask, score_mod=score_mod, extra_params=params)
    )


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_backend_matches_oracle(case: Case, backend: str) -> None:
    run_case(case, backend)


BAND_CASES = [c for c in CASES if c.mask in ("window", "window2")]


@pytest.mark.parametrize("case", BAND_CASES, ids=str)
def test_blocksparse_bands_without_compiled_kernels(case: Case, torch_kernels: None) -> None:
    """The band cases again with qkv's compiled kernel off (QKV_NATIVE=0): the path of every
    machine without a C++ compiler (torch's fused kernel on batched band tiles)."""
    run_case(case, "blocksparse")


def test_matrix_covers_every_axis_value() -> None:
    seen = {
        "B": {c.B for c in CASES},
        "heads": {(c.Hq, c.Hkv) for c in CASES},
        "lengths": {(c.Lq, c.Lk) for c in CASES},
        "dims": {(c.D, c.Dv) for c in CASES},
        "mask": {c.mask for c in CASES},
        "score": {c.score for c in CASES},
        "dtype": {c.dtype for c in CASES},
    }
    assert seen["B"] >= set(BATCH)
    assert seen["heads"] >= set(HEADS)
    assert seen["lengths"] >= set(LENGTHS)
    assert seen["dims"] >= set(DIMS)
    assert seen["mask"] >= set(MASKS)
    assert seen["score"] >= set(SCORES)
    assert seen["dtype"] >= set(DTYPES)
    # sdpa must actually run (not only refuse) on a good share of the matrix
    runnable = 0
    for c in CASES:
        gen = torch.Generator().manual_seed(0)
        q = torch.zeros(c.B, c.Hq, c.Lq, c.D, dtype=c.dtype)
        k = torch.zeros(c.B, c.Hkv, c.Lk, c.D, dtype=c.dtype)
        v = torch.zeros(c.B, c.Hkv, c.Lk, c.Dv, dtype=c.dtype)
        p = qkv._problem.validate(
            q, k, v, mask=make_mask(c.mask, c, gen), score_mod=make_score(c.score, c, gen)[0]
        )
        runnable += BACKENDS["sdpa"].rejects(p) is None
    assert runnable >= len(CASES) // 3

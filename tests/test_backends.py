"""Every backend against the float64 oracle on a randomized matrix of problems.

The matrix covers each value of each axis (batch, head grouping, lengths with Lq != Lk, head
dims with Dv != D, every built-in mask and score mod, bool tensors, arbitrary mask_mods, fully
masked rows, fp32 and bf16, and memory layouts of q, k, v and the upstream gradient: strided
last dims, transposed and permuted storage, offset views, expanded heads) by cycling every axis
at a different stride, so the cases mix the axes without running the full product. Each case
checks the output, the lse where the backend returns one, and the gradients of q, k, v and of
any bias / score_mod table, with a random upstream gradient.
"""

from __future__ import annotations

import functools
import re
import zlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import qkv
from catalogue import (
    BACKENDS,
    BATCHES,
    DIM_PAIRS,
    DTYPES,
    HEADS,
    LAYOUTS,
    LENGTH_PAIRS,
    SHAPES,
    Shape,
    lay_out,
    make_mask,
    make_qkv,
    make_score,
)
from qkv_testing import assert_matches_oracle, compare_to_oracle

# The catalogue's entries this matrix cycles through (catalogue.MASKS / SCORES say what each
# is for): every built-in, and/or combinations, bool tensors, arbitrary mask_mods, a
# head-dependent mask and fully masked rows.
MASKS = [
    "none",
    "causal",
    "window",
    "window2",
    "document",
    "padding",
    "prefix_lm",
    "and",
    "or_mod",
    "bool",
    "prefix_mod",
    "dilated",
    "head_dependent",
    "rows_masked",
]
SCORES = ["none", "bias", "alibi", "softcap", "relative", "closure"]


@dataclass
class Case:
    shape: Shape
    mask: str
    score: str
    dtype: torch.dtype
    layout: str = "contiguous"  # of q, k, v and the upstream gradient (catalogue.LAYOUTS)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        lay = "" if self.layout == "contiguous" else f"-{self.layout}"
        return f"{self.shape}-{self.mask}-{self.score}-{dt}{lay}"


def _cases(n: int) -> list[Case]:
    axes = [BATCHES, HEADS, LENGTH_PAIRS, DIM_PAIRS, MASKS, SCORES, DTYPES, LAYOUTS]
    out = []
    for i in range(n):
        # Every axis cycles through its values; the axes have different lengths, so the
        # combinations keep changing while every value of every axis shows up.
        pick = [ax[(i + 3 * j) % len(ax)] for j, ax in enumerate(axes)]
        B, (Hq, Hkv), (Lq, Lk), (D, Dv), mask, score, dtype, layout = pick
        if Lq * Lk > 100_000:
            B = 1  # keep the float64 oracle of the long cases cheap
        out.append(Case(Shape(B, Hq, Hkv, Lq, Lk, D, Dv), mask, score, dtype, layout))
    return out


def _coverage_cases() -> list[Case]:
    cases = _cases(len(MASKS) * len(SCORES))
    # plus every mask on one small GQA shape, with and without a score mod
    small = [Case(SHAPES["tiny"], m, s, torch.float32) for m in MASKS for s in ("none", "alibi")]
    return cases + small


CASES = _coverage_cases()


def _refusal(q, k, v, *, backend: str, **kw) -> str | None:
    """Why ``backend`` cannot compute this problem (its ``qkv.plan`` refusal), or None."""
    if backend == "auto":
        return None
    try:
        qkv.plan(q, k, v, backend=backend, **kw)
    except ValueError as e:
        return str(e)
    return None


def run_case(case: Case, backend: str) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    # Triton's kernels run on the GPU where there is one (compiled), else in its interpreter.
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else None
    q, k, v = (
        lay_out(t, case.layout) for t in make_qkv(case.shape, dtype=case.dtype, gen=gen, device=dev)
    )
    mask = make_mask(case.mask, case.shape, gen, device=dev)
    score_mod, params = make_score(case.score, case.shape, gen, device=dev)
    want_lse = backend != "sdpa"
    fn = functools.partial(qkv.attention, backend=backend, return_lse=want_lse)
    why = _refusal(q, k, v, mask=mask, score_mod=score_mod, return_lse=want_lse, backend=backend)
    if why is not None:
        assert "cannot compute this problem" in why, why
        with pytest.raises(ValueError, match="cannot compute this problem"):
            fn(q, k, v, mask=mask, score_mod=score_mod)
        return
    # decode has no backward (it refuses calls that need one: tests/test_decode.py): forward
    # and lse only
    grads = backend != "decode"
    assert_matches_oracle(
        compare_to_oracle(
            fn,
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            extra_params=params,
            grads=grads,
            grad_layout=case.layout,
        )
    )


def test_the_matrix_runs_every_backend() -> None:
    """The backends named in qkv's own error message are exactly the ones the matrix runs."""
    with pytest.raises(ValueError, match=re.escape(f"valid backends are {BACKENDS}")):
        qkv.plan(*(torch.zeros(1, 1, 1, 1),) * 3, backend="no such backend")


def _matrix() -> list[Any]:
    """Every case on every backend. Triton's kernels run in its interpreter on the CPU (a
    hundred times slower than compiled): past ~20 K scores per head its cases are extended
    (``make test-all``); the default run keeps the small ones of every axis value, and
    tests/test_triton.py its multi-tile cases."""
    params = []
    for case in CASES:
        for backend in BACKENDS:
            big = case.shape.Lq * case.shape.Lk > 20_000 and backend == "triton"
            marks = [pytest.mark.extended] if big else []
            params.append(pytest.param(case, backend, marks=marks, id=f"{case}-{backend}"))
    return params


@pytest.mark.parametrize(("case", "backend"), _matrix())
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
        "B": {c.shape.B for c in CASES},
        "heads": {(c.shape.Hq, c.shape.Hkv) for c in CASES},
        "lengths": {(c.shape.Lq, c.shape.Lk) for c in CASES},
        "dims": {(c.shape.D, c.shape.Dv) for c in CASES},
        "mask": {c.mask for c in CASES},
        "score": {c.score for c in CASES},
        "dtype": {c.dtype for c in CASES},
        "layout": {c.layout for c in CASES},
    }
    assert seen["B"] >= set(BATCHES)
    assert seen["heads"] >= set(HEADS)
    assert seen["lengths"] >= set(LENGTH_PAIRS)
    assert seen["dims"] >= set(DIM_PAIRS)
    assert seen["mask"] >= set(MASKS)
    assert seen["score"] >= set(SCORES)
    assert seen["dtype"] >= set(DTYPES)
    assert seen["layout"] >= set(LAYOUTS)
    # sdpa must actually run (not only refuse) on a good share of the matrix
    runnable = 0
    for c in CASES:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.zeros_like(t) for t in make_qkv(c.shape, dtype=c.dtype))
        mask = make_mask(c.mask, c.shape, gen)
        score_mod = make_score(c.score, c.shape, gen)[0]
        runnable += _refusal(q, k, v, mask=mask, score_mod=score_mod, backend="sdpa") is None
    assert runnable >= len(CASES) // 3


@pytest.mark.parametrize(
    "shape", [Shape(2, 9, 3, 1, 113, 59), Shape(1, 8, 1, 1, 1025, 64, 32)], ids=str
)
def test_sdpa_decode_step_folds_query_heads_into_rows(shape: Shape) -> None:
    """One query row with GQA and no mask: SDPA runs on the kv heads with each group's query
    heads as rows (no expansion of k, v); forward and gradients against the oracle."""
    q, k, v = make_qkv(shape, gen=7)
    assert "query heads as" in qkv.plan(q, k, v, backend="sdpa").forward
    fn = functools.partial(qkv.attention, backend="sdpa")
    assert_matches_oracle(compare_to_oracle(fn, q, k, v))

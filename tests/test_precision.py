"""Gradient precision where many query heads share one kv head.

The block-sparse engine's matmul backward used to compute a kv head's dk and dv with one GEMM
over its whole group of query heads (``g * rows`` terms summed at once). Where MKL adds such a
reduction in order (the AMD EPYC of benchmarks/RESULTS.md, 2026-12-01, and machines without
AVX-512), that came out up to ~11x further from the float64 oracle than plain PyTorch, which
sums per head and then over the heads. These cases failed the oracle comparison before the
backward summed per query head first (``group_sum`` in backends/blocksparse/grads.py), at
the unchanged 3x gradient ratio.

The cases are narrow (D=8: MKL's in-order path) with few visible keys and a callable
score_mod (which sends them to the matmul backward). ``python tests/test_precision.py``
prints their error ratios.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import pytest
import torch

import qkv
from catalogue import Shape, make_mask, make_qkv, make_score
from qkv_testing import Comparison, assert_matches_oracle, compare_to_oracle
from test_backends import Case, run_case
from test_blocksparse_oracle import _cases as oracle_cases
from test_blocksparse_oracle import _id as oracle_id


@dataclass(frozen=True)
class GroupCase:
    name: str
    Hq: int
    Hkv: int
    keys: int  # keys 0 .. keys-1 are visible to every query
    q_scale: float = 1.0
    v_scale: float = 1.0
    Lq: int = 128  # one query block: a kv head's reduction is Hq // Hkv * Lq terms
    Lk: int = 256
    D: int = 8

    def __str__(self) -> str:
        return self.name


GROUP_CASES = [
    # dv 11.4x plain's error before (2048 terms at once), 1.1x after.
    GroupCase("dv-16x1-5keys", 16, 1, 5),
    # dk 4.9x plain before, 0.8x after; v's scale lifts the errors above the 1e-5 floor (dk
    # grows with v through dP = dO vᵀ; dv does not).
    GroupCase("dk-16x1-40keys", 16, 1, 40, q_scale=2.0, v_scale=16.0),
    # multi-query: dk 6.1x plain before, 1.3x after.
    GroupCase("mqa-32x1-40keys", 32, 1, 40, q_scale=4.0, v_scale=16.0),
]


def group_comparisons(c: GroupCase, backend: str = "blocksparse") -> list[Comparison]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, c.Hq, c.Lq, c.D, generator=gen) * c.q_scale  # [B, Hq, Lq, D]
    k = torch.randn(1, c.Hkv, c.Lk, c.D, generator=gen)  # [B, Hkv, Lk, D]
    v = torch.randn(1, c.Hkv, c.Lk, c.D, generator=gen) * c.v_scale  # [B, Hkv, Lk, D]
    keys = c.keys

    def first_keys(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor):
        return j < keys

    fn = functools.partial(qkv.attention, backend=backend, return_lse=True)
    return compare_to_oracle(fn, q, k, v, mask=first_keys, score_mod=qkv.softcap(2.0))


@pytest.mark.parametrize("backend", ["auto", "blocksparse"])
@pytest.mark.parametrize("case", GROUP_CASES, ids=str)
def test_gqa_gradients_sum_per_head(case: GroupCase, backend: str) -> None:
    res = group_comparisons(case, backend)
    assert {c.name for c in res} >= {"dq", "dk", "dv"}, "a gradient was not compared"
    assert_matches_oracle(res)


# The test_backends.py matrix case that failed on CPUs without AVX-512: dv 7.1x
# plain's error before, 1.0x after.
MATRIX_CASE = Case(Shape(1, 8, 1, 113, 256, 8, 8), "prefix_mod", "softcap", torch.float32)


@pytest.mark.parametrize("backend", ["auto", "blocksparse"])
def test_matrix_case_of_issue_9(backend: str) -> None:
    run_case(MATRIX_CASE, backend)


def matrix_comparisons(backend: str = "blocksparse") -> list[Comparison]:
    """``run_case(MATRIX_CASE, backend)``'s comparisons (the same inputs), for printing."""
    c = MATRIX_CASE
    gen = torch.Generator().manual_seed(zlib.crc32(str(c).encode()))
    q, k, v = make_qkv(c.shape, dtype=c.dtype, gen=gen)  # as run_case draws them
    mask = make_mask(c.mask, c.shape, gen)
    score_mod, params = make_score(c.score, c.shape, gen)
    fn = functools.partial(qkv.attention, backend=backend, return_lse=True)
    return compare_to_oracle(fn, q, k, v, mask=mask, score_mod=score_mod, extra_params=params)


def test_matrix_comparisons_replicate_run_case() -> None:
    """The printed numbers are the matrix test's: same inputs, same verdict."""
    res = matrix_comparisons()
    assert {c.name for c in res} >= {"out", "lse", "dq", "dk", "dv"}
    assert_matches_oracle(res)


def test_gqa_cases_reach_the_matmul_backward() -> None:
    """The cases test the engine's own backward only if its plan is the matmul path."""
    for c in GROUP_CASES:
        q = torch.randn(1, c.Hq, c.Lq, c.D)
        k = v = torch.randn(1, c.Hkv, c.Lk, c.D)
        plan = str(qkv.plan(q, k, v, mask=lambda b, h, i, j: j < 5, score_mod=qkv.softcap(2.0)))
        assert "backend 'blocksparse'" in plan and "explicit matmuls" in plan, plan


def gemm_orders(g: int = 8, rows: int = 113, span: int = 128, X: int = 8) -> str:
    """The root cause alone: a kv head's dv as one GEMM over its folded group (``g * rows``
    terms), as per-head GEMMs summed over the group, and as an in-order float32 sum, each
    against float64. Five visible keys, as in MATRIX_CASE."""
    gen = torch.Generator().manual_seed(0)
    pd = torch.zeros(g, rows, span)  # [g, rows, span]: probabilities of one kv head's group
    pd[..., :5] = torch.rand(g, rows, 5, generator=gen) * 0.4
    do = torch.randn(g, rows, X, generator=gen)  # [g, rows, X]
    flat_p, flat_d = pd.reshape(g * rows, span), do.reshape(g * rows, X)  # [g*rows, span|X]
    exact = flat_p.double().T @ flat_d.double()  # [span, X]
    folded = flat_p.T @ flat_d
    per_head = (pd.transpose(-2, -1) @ do).sum(0)  # [g, span, X] -> [span, X]
    in_order = torch.zeros(span, X)
    for r in range(g * rows):
        in_order += flat_p[r, :, None] * flat_d[r]

    def err(t: torch.Tensor) -> str:
        return f"{float((t.double() - exact).abs().max()):.3g}"

    return (
        f"dv of {g} heads x {rows} rows: one GEMM over {g * rows} terms {err(folded)}, "
        f"per head then over heads {err(per_head)}, in-order float32 sum {err(in_order)} "
        f"(the GEMM's result identical to it: {torch.equal(folded, in_order)})"
    )


if __name__ == "__main__":  # the numbers behind the comments above
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(gemm_orders())
    runs = [(str(MATRIX_CASE), matrix_comparisons)]
    runs += [(str(c), functools.partial(group_comparisons, c)) for c in GROUP_CASES]
    for name, run in runs:
        res = {r.name: r for r in run()}
        print(
            f"{name}: "
            + "  ".join(
                f"{n} {res[n].err:.2e} vs plain {res[n].plain_err:.2e} "
                f"({res[n].err / res[n].plain_err:.1f}x{'' if res[n].ok else ' FAIL'})"
                for n in ("dq", "dk", "dv")
            )
        )


# The block-sparse matrix case whose ALiBi slope gradient failed the AVX2 rerun.
SLOPE_CASE = "and-alibi-fp32-L113x256-D128v128-H1/1-B2-blkNone"


def _slope_errors() -> tuple[float, float]:
    """The ALiBi slope's gradient error against float64 on SLOPE_CASE, as the matrix test
    draws it: qkv's engine (explicit matmuls, as a score_mod needs) and the plain formula in
    float32 (``backend="reference"``, whose error here is the same on every ISA; the
    matrix's own plain peer is 3.7e-5 under AVX2 and 1.6e-4 under AVX-512)."""
    (c,) = [c for c in oracle_cases() if oracle_id(c) == SLOPE_CASE]
    errs = []
    for backend in ("blocksparse", "reference"):
        gen = torch.Generator().manual_seed(c["seed"])
        shape = Shape(c["B"], 1, 1, c["Lq"], c["Lk"], c["D"], c["Dv"])
        q, k, v = make_qkv(shape, dtype=c["dtype"], gen=gen)
        mask = make_mask(c["mask"], shape, gen)
        score_mod, params = make_score(c["score"], shape, gen)
        fn = functools.partial(qkv.attention, backend=backend, return_lse=True)
        res = compare_to_oracle(
            fn, q, k, v, mask=mask, score_mod=score_mod, extra_params=params, seed=c["seed"]
        )
        errs.append(next(r.err for r in res if r.name == "dparam0"))
    return errs[0], errs[1]


def test_alibi_slope_gradient_sums_whole_rows_exactly():
    """A slope's gradient is sum(dS * (kv - q)): each row of dS must sum to 0, or the row's
    residue is multiplied by its distance. The engine's saved lse once summed exp in float32,
    so the backward's recomputed rows of P summed to 1 + ~1e-7: dslope 6.8x the plain
    formula's error here, on every ISA (1.6e-4 vs 2.4e-5); with the row sums in float64,
    1.6x (3.7e-5)."""
    fast, plain = _slope_errors()
    assert fast <= 3 * plain + 1e-6, (fast, plain)

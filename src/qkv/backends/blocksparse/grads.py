"""Gradient accumulators of the block-sparse backward, and the sums they need: per-head
partial sums combined once over a GQA group, a bias's broadcast dims, the lse split for an
exact recompute."""

from __future__ import annotations

import torch

from ..base import HUGE_LOGIT
from .job import Job, Piece

Tensor = torch.Tensor


class Grads:
    """Gradient accumulators in the compute dtype."""

    def __init__(
        self,
        job: Job,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        need: list[bool],
        written: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """``written``: key ranges whose dk and dv the caller will write (not add) in full;
        only the other keys are zero-filled."""
        cdt = job.p.compute_dtype
        self.dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        if written:
            self.dk = torch.empty(k.shape, dtype=cdt, device=k.device)
            self.dv = torch.empty(v.shape, dtype=cdt, device=v.device)
            at = 0
            for k0, k1 in [*written, (k.shape[2], k.shape[2])]:
                if k0 > at:
                    self.dk[:, :, at:k0].zero_()
                    self.dv[:, :, at:k0].zero_()
                at = max(at, k1)
        else:
            self.dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
            self.dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
        b = job.bias
        self.dbias = (
            torch.zeros(b.shape, dtype=cdt, device=b.device) if b is not None and need[3] else None
        )
        self.dparams: list[Tensor | None] = [None] * len(job.params)

    @classmethod
    def of(cls, job: Job, dq: Tensor, dk: Tensor, dv: Tensor) -> Grads:
        """Finished gradients (no bias, no score_mod tensors), from a kernel that computed
        them whole."""
        g = cls.__new__(cls)
        g.dq, g.dk, g.dv = dq, dk, dv
        g.dbias = None
        g.dparams = [None] * len(job.params)
        return g

    def add_keys(self, acc: Tensor, pc: Piece, g: Tensor) -> None:
        """Add a piece's ``g [B, Hkv, span, X]`` into ``acc [B, Hkv, Lk, X]`` at its keys."""
        g = g.to(acc.dtype)
        if len(pc.runs) == 1:
            k0, k1 = pc.runs[0]
            acc[:, :, k0:k1] += g
        else:
            assert pc.index is not None
            acc.index_add_(2, pc.index.to(acc.device), g)


def group_sum(t: Tensor, hkv: int) -> Tensor:
    """Per-query-head partial sums ``t [B, Hq, span, X]`` combined over each kv head's group
    of query heads: ``[B, Hkv, span, X]`` (query head ``h`` feeds kv head ``h // g``).

    Why not one GEMM over the folded group (``fold(a, hkv)ᵀ @ fold(b, hkv)``, a reduction of
    ``g*rows`` terms): MKL may add a reduction in order, one accumulator per output (on the
    AMD EPYC of RESULTS.md, 2026-12-01, its error equals an in-order float32 sum's to the
    last bit), so the error grows with the reduction's length. With 8 query heads on one kv
    head and 113 rows, dv summed 904 terms at once and came out 7.1x further from the
    float64 oracle than plain PyTorch (which sums per head, then over heads), dk
    3.0x; per head (113 terms) and then over the 8 heads, 1.0x and 1.4x. The same FLOPs; the
    extra ``[B, Hq, span, X]`` buffer is ``g`` times the piece's keys ``[B, Hkv, span, X]``
    and ``X / rows`` times its scores, so the piece budget still bounds it."""
    B, Hq, S, X = t.shape
    if Hq == hkv:
        return t
    return t.view(B, hkv, Hq // hkv, S, X).sum(dim=2)  # [B, Hkv, span, X]


def lse_for_bwd(lse: Tensor) -> Tensor:
    # Rows with no visible key have lse -inf; every score of such a row is -inf too, so any
    # finite value gives P = exp(-inf - x) = 0 there.
    return lse.masked_fill(lse == float("-inf"), 0.0)  # (a NaN stays a NaN)


def lse_hi_lo(lse: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The (float64) lse as ``hi + lo`` in ``dtype``: ``exp((s - hi) - lo)`` loses nothing to
    the rounding of a large lse (``s - hi`` is exact where it matters, by Sterbenz's lemma)."""
    lse64 = lse_for_bwd(lse).double()
    hi = lse64.to(dtype)
    return hi, (lse64 - hi.double()).to(dtype)


def add_bias_grad(job: Job, pc: Piece, dbias: Tensor, ds: Tensor) -> None:
    """Sum ``ds [B, Hq, rows, span]`` over the bias's broadcast dims into ``dbias``."""
    bias = job.bias
    assert bias is not None
    red = ds
    for dim in (0, 1):
        if bias.shape[dim] == 1:
            red = red.sum(dim=dim, keepdim=True)
    if bias.shape[2] == 1:
        red = red.sum(dim=2, keepdim=True)
    if bias.shape[3] == 1:
        red = red.sum(dim=3, keepdim=True)
    rows = slice(pc.q0, pc.q1) if bias.shape[2] > 1 else slice(None)
    if bias.shape[3] == 1:
        dbias[:, :, rows] += red
    elif len(pc.runs) == 1:
        k0, k1 = pc.runs[0]
        dbias[:, :, rows, k0:k1] += red
    else:
        assert pc.index is not None
        sub = dbias[:, :, rows]
        sub.index_add_(3, pc.index.to(ds.device), red)


def huge_lse(lse: Tensor) -> bool:
    """Rows whose |lse| is beyond what the fused kernel's recomputed scores keep exact."""
    if lse.numel() == 0:
        return False
    finite = torch.nan_to_num(lse, nan=0.0, posinf=0.0, neginf=0.0)  # (3 ops: 15 -> 7 us)
    return bool(finite.abs().amax() > HUGE_LOGIT)

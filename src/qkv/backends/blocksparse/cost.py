"""What a masked call costs on the block-sparse engine and on SDPA with the dense mask: the
estimates ``auto`` weighs (:func:`weigh`), which ``qkv.plan`` prints.

A mask that hides little leaves the engine nothing to skip, and its many smaller fused calls
(one per document, per query block, per band group) each pay a fixed cost that one dense call
pays once; a mask that hides most of the scores leaves SDPA computing what the engine skips.
Neither wins everywhere, so ``auto`` estimates both from the job the engine would run (the
pairs each of its calls computes, how many calls, how many scores take an evaluated mask)
and the dense problem, in one unit: a multiply-add of SDPA's fused CPU kernel on a dense
mask. The constants below are each route's cost per pair relative to that kernel, and a call's
fixed cost, measured with ``benchmarks/auto_sweep.py --calibrate`` (benchmarks/RESULTS.md);
the engine is taken only where its estimate is below :data:`MARGIN` of SDPA's, so that an
estimate's error falls on SDPA's side (the peer a user would otherwise call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._core.problem import Problem
from .job import Job

# Measured with ``benchmarks/auto_sweep.py --calibrate --threads 1`` on a 2-core AMD EPYC
# (AVX-512; benchmarks/RESULTS.md, 2026-12-08), each against SDPA's fused kernel with a
# dense mask (1.0 per pair and head dim, forward). Where a figure was uncertain it was
# rounded up: an overestimate sends a call to SDPA, the peer, never to a slower engine.
# The compiled band kernel (float32): per pair about the dense call's, without its mask.
BAND_KERNEL = 1.1
# torch's fused kernel on a mask-free piece of the problem (a document, a prefix).
SEGMENT = 1.0
# torch's fused kernel on query blocks against their visible keys (band groups, pieces):
# 1.25 on one thread, more on two (small calls split poorly over threads; a window or a
# prefix at L=1024 measured 1.09x SDPA dense at an estimate of 0.75).
PIECE = 1.5
# Explicit matmuls (a score_mod, dropout, a bias gradient): scores materialised per piece.
MATMUL = 2.5
# bfloat16 and float16: the engine's smaller calls convert per call (segments and pieces),
# and their backwards twice again (documents with gradients at L=256 measured 1.18-1.24x
# SDPA dense at estimates of ~0.5, 2 threads).
HALF = 1.3
HALF_BACKWARD = 2.0
# The backward relative to the forward: torch's fused backward (SDPA's and the engine's
# calls); the band kernel's own backward is slower relative to its forward.
BACKWARD = {"torch": 2.5, "band": 3.6}
# Fixed costs, in multiply-adds of the dense call's: SDPA's one call; the band kernel's one
# call; each of the engine's fused calls (slicing, output and lse copies: a prefix-LM at
# L=64 took 4.5x SDPA's time with three of them); each merged output element (two partial
# results combined by their lse in float64: several passes over the rows).
CALL_SDPA = 1.0e6
CALL_BAND = 0.5e6
CALL = 8.0e6
MERGE = 600.0
# With gradients: the engine's autograd around its calls (its own Function and operators,
# the saved lse; a small training call through the band kernel measured 1.7-1.9x SDPA's
# route), and each fused call's backward (its gradients added into the whole dq, dk, dv).
GRAD = 4.0e6
CALL_BACKWARD = 16.0e6
# Evaluating a mask on partial tiles, per score (an additive mask per piece).
MASKED = 24.0
# torch's fused causal kernel skips whole blocks above the diagonal only: a causal segment
# of n rows computes about half of n^2 when n is well above this many rows, all of it below.
CAUSAL_BLOCK = 256
# auto takes the engine where its estimate is below this share of SDPA's.
MARGIN = 0.8


@dataclass(frozen=True)
class Costs:
    """Estimated costs of one call, in multiply-adds of SDPA's fused kernel (forward, plus
    the backward when gradients are needed)."""

    sdpa: float  # SDPA with the mask as a dense tensor
    blocksparse: float  # the engine's job
    route: str  # the engine's route (``Job.route``)

    @property
    def ratio(self) -> float:
        return self.blocksparse / self.sdpa if self.sdpa > 0 else float("inf")

    @property
    def prefers_blocksparse(self) -> bool:
        return self.ratio < MARGIN

    def __str__(self) -> str:
        return (
            f"estimated cost {self.blocksparse / 1e6:,.0f} M for blocksparse ({self.route}) "
            f"against {self.sdpa / 1e6:,.0f} M for SDPA with the dense mask "
            f"({self.ratio:.2f}x; auto takes blocksparse below {MARGIN}x)"
        )


def weigh(p: Problem, job: Job) -> Costs:
    """The estimated costs of ``p`` on SDPA with a dense mask and on ``job`` (the engine's
    plan for ``p``)."""
    width = p.D + p.Dv
    heads = p.B * p.Hq
    grad = p.requires_grad()
    calls_x = 2 if grad else 1  # (a backward makes as many calls again)
    torch_x = 1.0 + (BACKWARD["torch"] if grad else 0.0)
    sdpa = heads * p.Lq * p.Lk * width * torch_x + CALL_SDPA * calls_x
    pairs, calls, masked, merged = _work(job, p)
    if job.route == "native_band":
        per_pair = BAND_KERNEL * (1.0 + (BACKWARD["band"] if grad else 0.0))
        bs = heads * pairs * width * per_pair + CALL_BAND * calls_x
    else:
        rate = (SEGMENT if job.route == "segments" else PIECE) if job.fused else MATMUL
        backward = BACKWARD["torch"] if grad else 0.0
        if p.dtype in (torch.float16, torch.bfloat16):
            rate *= HALF
            backward *= HALF_BACKWARD
        bs = heads * pairs * width * rate * (1.0 + backward)
        bs += calls * (CALL + (CALL_BACKWARD * grad))
        bs += heads * (masked * MASKED * calls_x + merged * p.Dv * MERGE)
    bs += GRAD * grad
    return Costs(sdpa=float(sdpa), blocksparse=float(bs), route=job.route)


def _work(job: Job, p: Problem) -> tuple[float, int, float, float]:
    """``(pairs, calls, masked, merged)`` of one batch element and head: the (query, key)
    pairs the job's forward computes, its fused calls, the pairs on which it evaluates the
    mask, and the query rows whose partial results it merges (once per extra part)."""
    if job.route == "native_band":
        lo, hi = job.native_band or (-p.Lq, p.Lk)
        i = torch.arange(p.Lq, dtype=torch.float64)
        first = (i + lo).clamp(0, p.Lk)
        end = (i + hi + 1).clamp(0, p.Lk)
        pairs = float((end - first).clamp(min=0).sum())
        return pairs * _share(p), 1, 0.0, 0.0  # (a padding or document mask's share)
    pairs = masked = merged = 0.0
    calls = 0
    rows_seen: set[tuple[int, int]] = set()
    for q0, q1, k0, k1, causal in job.segments:
        n = q1 - q0
        share = 0.5 + 0.5 * min(1.0, CAUSAL_BLOCK / max(1, n)) if causal else 1.0
        pairs += n * (k1 - k0) * share
        calls += 1
        if (q0, q1) in rows_seen:
            merged += n
        rows_seen.add((q0, q1))
    for row in job.fwd.rows:
        for pc in row:
            pairs += (pc.q1 - pc.q0) * pc.span
            masked += (pc.q1 - pc.q0) * sum(k1 - k0 for _, k0, k1 in pc.masked)
        calls += len(row)
        merged += (len(row) - 1) * (row[0].q1 - row[0].q0) if row else 0
    for g in job.fwd.groups:
        pairs += g.n * g.b * g.w * g.b
        masked += g.n * g.b * g.w * g.b if job.masked else 0.0
        calls += 1
    return pairs, calls, masked, merged


def _share(p: Problem) -> float:
    """The share of the band's pairs a key range per batch element or document ids leave
    (1.0 when the mask is a band alone): padding's mean key range over its batch; for sorted
    document ids, the pairs inside documents over all pairs (an upper bound inside a band)."""
    t = p.mask.terms
    share = 1.0
    if t.keys is not None:
        first, end = t.keys.per_batch(p.B)
        share *= float((end - first).clamp(min=0).double().mean()) / max(1, p.Lk)
    if t.ids is not None:
        ids = t.ids.detach().to("cpu")
        rows = ids.reshape(-1, ids.shape[-1])[:, : max(p.Lq, p.Lk)]
        if rows.numel() and bool((rows[:, 1:] >= rows[:, :-1]).all()):
            # (unsorted ids are masked score by score over the whole band: no share)
            inside = 0.0
            for r in rows:
                _, counts = torch.unique_consecutive(r, return_counts=True)
                inside += float((counts.double() ** 2).sum())
            share *= inside / (rows.shape[0] * rows.shape[1] ** 2)
    return min(1.0, share)

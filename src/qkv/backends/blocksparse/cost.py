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

# Per pair and head dim, relative to SDPA's fused kernel with a dense mask (1.0), forward.
# The compiled band kernel (float32): register-blocked products, no mask tensor to read.
BAND_KERNEL = 0.55
# torch's fused kernel on a mask-free piece of the problem (a document, a prefix): no mask
# to read, but smaller calls run below the dense call's efficiency.
SEGMENT = 1.0
# torch's fused kernel on query blocks against their visible keys (band groups and pieces),
# with their results merged by lse.
PIECE = 1.6
# Explicit matmuls (a score_mod, dropout, a bias gradient): scores materialised per piece.
MATMUL = 2.5
# A fused call's fixed cost (dispatch, output and lse copies, the merge), in multiply-adds of
# the dense call's; the same for SDPA's single call.
CALL = 2.0e6
# Evaluating a mask on partial tiles, per score (an additive mask per piece).
MASKED = 24.0
# The backward, relative to the forward, per route: torch's fused backward recomputes the
# scores and runs four more products; the band kernel's backward likewise.
BACKWARD = {"sdpa": 2.5, "torch": 2.5, "band": 3.0}
# bfloat16 and float16: torch's fused kernel converts per block; its dense-mask call reads
# a float mask in the input dtype. The engine's pieces pay the conversions per call.
HALF_PIECE = 1.25
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
    half = p.dtype in (torch.float16, torch.bfloat16)
    grad = p.requires_grad()
    sdpa = heads * p.Lq * p.Lk * width * (1.0 + (BACKWARD["sdpa"] if grad else 0.0))
    sdpa += CALL * (2 if grad else 1)
    pairs, calls, masked = _work(job, p)
    if job.route == "native_band":
        per_pair = BAND_KERNEL * (1.0 + (BACKWARD["band"] if grad else 0.0))
    else:
        rate = (SEGMENT if job.route == "segments" else PIECE) if job.fused else MATMUL
        if half and job.route != "segments":
            rate *= HALF_PIECE
        per_pair = rate * (1.0 + (BACKWARD["torch"] if grad else 0.0))
    bs = heads * pairs * width * per_pair + calls * CALL * (2 if grad else 1)
    bs += heads * masked * MASKED * (2 if grad else 1)
    return Costs(sdpa=float(sdpa), blocksparse=float(bs), route=job.route)


def _work(job: Job, p: Problem) -> tuple[float, int, float]:
    """``(pairs, calls, masked)`` of one batch element and head: the (query, key) pairs the
    job's forward computes, its fused calls, and the pairs on which it evaluates the mask."""
    if job.route == "native_band":
        lo, hi = job.native_band or (-p.Lq, p.Lk)
        i = torch.arange(p.Lq, dtype=torch.float64)
        first = (i + lo).clamp(0, p.Lk)
        end = (i + hi + 1).clamp(0, p.Lk)
        pairs = float((end - first).clamp(min=0).sum())
        share = _share(p)  # a padding or document mask's own share of the band
        return pairs * share, 1, 0.0
    pairs = 0.0
    calls = 0
    for q0, q1, k0, k1, causal in job.segments:
        pairs += (q1 - q0) * (k1 - k0) * (0.5 if causal else 1.0)
        calls += 1
    masked = 0.0
    for row in job.fwd.rows:
        for pc in row:
            pairs += (pc.q1 - pc.q0) * pc.span
            masked += (pc.q1 - pc.q0) * sum(k1 - k0 for _, k0, k1 in pc.masked)
        calls += 1 if row else 0
    for g in job.fwd.groups:
        pairs += g.n * g.b * g.w * g.b
        masked += g.n * g.b * g.w * g.b if job.masked else 0.0
        calls += 1
    return pairs, calls, masked


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

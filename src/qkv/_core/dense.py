"""Masks and score_mods over the whole ``[B, Hq, Lq, Lk]`` score grid.

Used by the backends that work on the full score matrix (the reference, and SDPA when it is
given a dense mask); the evaluation itself is :mod:`qkv._core.evaluate`'s, as for every other
region of the grid.
"""

from __future__ import annotations

import torch

from .evaluate import mask_at, score_at, whole
from .problem import Problem

Tensor = torch.Tensor


def dense_mask(p: Problem, rows: tuple[int, int] | None = None) -> Tensor | None:
    """The mask as a bool tensor broadcastable to ``[B, Hq, Lq, Lk]``, or ``None``; with
    ``rows`` ``(r0, r1)``, only query rows ``r0 <= i < r1`` (broadcastable to ``[B, Hq,
    r1 - r0, Lk]``)."""
    m = p.mask
    if m.is_none or (m.tensor is not None and rows is None):
        # Nothing to evaluate (no mask, or a bool tensor: its whole grid is itself), so no
        # region is built: that costs microseconds, a few % of a small SDPA call.
        return m.tensor
    b, h, q, k = whole(p.shape)
    return mask_at(m, b, h, rows or q, k, p.device)


def apply_score_mod(p: Problem, scores: Tensor, rows: tuple[int, int] | None = None) -> Tensor:
    """``scores [B, Hq, Lq, Lk]`` with the problem's score_mod (bias or callable) applied;
    with ``rows`` ``(r0, r1)``, ``scores`` are those query rows' only."""
    if p.score.is_none:  # as above: no region built for nothing to apply
        return scores
    b, h, q, k = whole(p.shape)
    return score_at(p.score, scores, b, h, rows or q, k)

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


def dense_mask(p: Problem) -> Tensor | None:
    """The mask as a bool tensor broadcastable to ``[B, Hq, Lq, Lk]``, or ``None``."""
    m = p.mask
    if m.kind == "none" or m.tensor is not None:
        # Nothing to evaluate (no mask, or a bool tensor: its whole grid is itself), so no
        # region is built: that costs microseconds, a few % of a small SDPA call.
        return m.tensor
    return mask_at(m, *whole(p.shape), p.device)


def apply_score_mod(p: Problem, scores: Tensor) -> Tensor:
    """``scores [B, Hq, Lq, Lk]`` with the problem's score_mod (bias or callable) applied."""
    if p.score.kind == "none":  # as above: no region built for nothing to apply
        return scores
    return score_at(p.score, scores, *whole(scores.shape))  # scores.shape is p.shape

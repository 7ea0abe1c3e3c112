"""Materialise masks and score_mods over the whole ``[B, Hq, Lq, Lk]`` score grid.

Used by the backends that work on the full score matrix (the reference, and SDPA when it is
given a dense mask). The block-sparse engine evaluates the same callables block by block.
"""

from __future__ import annotations

import torch

from ._checks import check_mask_result, check_score_result
from ._problem import Problem

Tensor = torch.Tensor


def dense_mask(p: Problem) -> Tensor | None:
    """The mask as a bool tensor broadcastable to ``[B, Hq, Lq, Lk]``, or ``None``."""
    m = p.mask
    if m.kind == "none":
        return None
    if m.tensor is not None:
        return m.tensor
    b, h, qi, ki = p.index_tensors()
    return check_mask_result(m.mask_mod(b, h, qi, ki), m.mask_mod, p.shape)


def apply_score_mod(p: Problem, scores: Tensor) -> Tensor:
    """``scores [B, Hq, Lq, Lk]`` with the problem's score_mod (bias or callable) applied."""
    sc = p.score
    if sc.bias is not None:
        return scores + sc.bias.to(scores.dtype)
    if sc.score_mod is None:
        return scores
    b, h, qi, ki = p.index_tensors()
    return check_score_result(
        sc.score_mod(scores, b, h, qi, ki), sc.score_mod, p.shape, scores.dtype
    )

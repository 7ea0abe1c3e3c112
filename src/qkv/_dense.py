"""Materialise masks and score_mods over the whole ``[B, Hq, Lq, Lk]`` score grid.

Used by the backends that work on the full score matrix (the reference, and SDPA when it is
given a dense mask). The block-sparse engine evaluates the same callables block by block.
"""

from __future__ import annotations

from typing import Any

import torch

from ._validate import Problem, check_mask_result, check_score_result

Tensor = torch.Tensor


def dense_mask(p: Problem) -> Tensor | None:
    """The mask as a bool tensor broadcastable to ``[B, Hq, Lq, Lk]``, or ``None``."""
    mask = p.mask
    if mask is None or isinstance(mask, Tensor):
        return mask
    mod = getattr(mask, "mask_mod", None)  # a block mask carries the mask_mod it was built from
    if mod is None:
        mod = mask
    return evaluate_mask_mod(mod, p)


def evaluate_mask_mod(mod: Any, p: Problem) -> Tensor:
    b, h, qi, ki = p.index_tensors()
    return check_mask_result(mod(b, h, qi, ki), mod, p.shape)


def apply_score_mod(p: Problem, scores: Tensor) -> Tensor:
    """``scores [B, Hq, Lq, Lk]`` with the problem's score_mod (bias or callable) applied."""
    sm = p.score_mod
    if sm is None:
        return scores
    if isinstance(sm, Tensor):
        return scores + sm.to(scores.dtype)
    b, h, qi, ki = p.index_tensors()
    return check_score_result(sm(scores, b, h, qi, ki), sm, p.shape, scores.dtype)

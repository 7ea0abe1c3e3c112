"""The oracle: attention as the plain three-step formula.

1. scores  = (q @ kᵀ) * scale, then the score_mod, then -inf where the mask forbids;
2. weights = softmax(scores) per query row;
3. out     = weights @ v.

Every other backend is tested against this module. It favours obviousness over speed: it
materialises the whole ``[B, Hq, Lq, Lk]`` score matrix and repeats K/V heads for GQA.
The only care it takes is numerical: a row whose keys are all masked gets weights 0 (not
NaN), output 0, log-sum-exp ``-inf`` and zero gradients, and huge scores never overflow.
"""

from __future__ import annotations

import torch

from ._core.dense import apply_score_mod, dense_mask
from ._core.problem import Problem
from ._door import validate
from .typing import MaskLike, ScoreLike

Tensor = torch.Tensor

__all__ = ["attention"]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskLike = None,
    *,
    score_mod: ScoreLike = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention by the plain formula, returning ``(out, weights)``.

    Args:
        q: ``[B, Hq, Lq, D]`` (or unbatched ``[Hq, Lq, D]`` / ``[Lq, D]``).
        k: ``[B, Hkv, Lk, D]`` with ``Hq % Hkv == 0``.
        v: ``[B, Hkv, Lk, Dv]``.
        mask, score_mod, scale: as in :func:`qkv.attention`.

    Returns:
        ``out [B, Hq, Lq, Dv]`` in q's dtype and ``weights [B, Hq, Lq, Lk]`` (float32 for
        half inputs, else q's dtype), both with the unbatched dims dropped like the inputs.
        Rows of ``weights`` sum to 1, or to 0 where every key is masked.

    Example::

        >>> import torch, qkv
        >>> q, k, v = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6, 8)
        >>> out, w = qkv.reference.attention(q, k, v)
        >>> out.shape, w.shape
        (torch.Size([4, 8]), torch.Size([4, 6]))
    """
    p = validate(q, k, v, mask=mask, score_mod=score_mod, scale=scale)
    out, _, weights = forward(p, dropout_p=0.0)
    return p.restore(out), p.restore(weights)


def forward(
    p: Problem, *, dropout_p: float, rows: tuple[int, int] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``out [B, Hq, Lq, Dv]``, ``lse [B, Hq, Lq]`` (float32; float64 for float64 inputs) and
    ``weights [B, Hq, Lq, Lk]``; with ``rows`` ``(r0, r1)``, those of query rows ``r0 <= i <
    r1`` only (``Lq`` becomes ``r1 - r0``: each row's attention is its own)."""
    cdt = p.compute_dtype
    g = p.groups
    mask = dense_mask(p, rows)  # evaluated first: a bad mask_mod fails before any arithmetic
    k = p.k.to(cdt).repeat_interleave(g, dim=1)  # [B, Hq, Lk, D]: query head h uses kv head h//g
    v = p.v.to(cdt).repeat_interleave(g, dim=1)  # [B, Hq, Lk, Dv]
    q = p.q if rows is None else p.q[:, :, rows[0] : rows[1]]

    scores = (q.to(cdt) @ k.transpose(-2, -1)) * p.scale  # [B, Hq, Lq, Lk]
    scores = apply_score_mod(p, scores, rows)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))

    # torch's softmax (its backward is the fused P * (dP - sum(P * dP)), fewer roundings than
    # differentiating exp and sum apart), with rows that see no key given weights 0 and lse
    # -inf instead of NaN. A NaN score is not such a row: its weights, out and lse stay NaN.
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)  # [B, Hq, Lq, 1]
    live = torch.where(dead, torch.zeros_like(scores), scores)
    weights = torch.where(dead, torch.zeros_like(scores), torch.softmax(live, dim=-1))
    lse = torch.where(
        dead,
        torch.full_like(dead, float("-inf"), dtype=cdt),
        torch.logsumexp(live, -1, keepdim=True),
    )

    probs = torch.nn.functional.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = probs @ v  # [B, Hq, Lq, Dv]
    return out.to(p.dtype), lse.squeeze(-1), weights

"""Exact attention weights rebuilt from the log-sum-exp, a few rows at a time.

A fast backend never forms the ``[B, Hq, Lq, Lk]`` weight matrix, but the ``lse [B, Hq, Lq]``
it returns is enough to recover any part of it exactly: for query row ``i`` and key ``j``,

    weight[i, j] = exp(score[i, j] - lse[i])        (0 where the mask forbids, or lse = -inf)

where ``score`` is the same ``(q @ kᵀ) * scale`` with the score_mod applied. So a few rows cost
``O(rows × Lk)`` memory, never ``O(Lq × Lk)``. Whole rows are then divided by their sum, which
is 1 up to rounding: the backend that computed ``lse`` rounded its scores differently from this
recomputation, and the division keeps that difference out of the weights (measured: without
it, errors reached ~2x those of plain float32 softmax at ``Lk = 1025`` with ALiBi).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._core.evaluate import mask_at, score_at
from .._core.problem import Problem
from .._door import validate
from ..typing import MaskLike, ScoreLike

Tensor = torch.Tensor
Index = int | Sequence[int] | Tensor | None


def check_problem(
    q: object, k: object, lse: object, mask: object, score_mod: object, scale: object
) -> tuple[Problem, Tensor]:
    """Validate like :func:`qkv.attention` and return the problem and ``lse [B, Hq, Lq]``."""
    # v only has to agree with k in shape for the checks; the weights never touch it.
    p = validate(q, k, k, mask=mask, score_mod=score_mod, scale=scale)
    return p, _check_lse(lse, p)


def _check_lse(lse: object, p: Problem) -> Tensor:
    if not isinstance(lse, Tensor):
        raise TypeError(
            f"lse must be the tensor qkv.attention(..., return_lse=True) returned, got "
            f"{type(lse).__name__}"
        )
    want = [p.B, p.Hq, p.Lq][4 - p.orig_ndim :]
    if list(lse.shape) != want:
        raise ValueError(
            f"lse has shape {list(lse.shape)} but q of shape {list(_orig_q_shape(p))} needs "
            f"{want} (one value per query row and head, as return_lse=True gives)"
        )
    if not lse.is_floating_point():
        raise TypeError(f"lse must be a float tensor, got dtype {lse.dtype}")
    if lse.device != p.device:
        raise ValueError(f"lse is on {lse.device} but q is on {p.device}; use lse.to(q.device)")
    return lse.reshape(p.B, p.Hq, p.Lq)  # [B, Hq, Lq]


def _orig_q_shape(p: Problem) -> tuple[int, ...]:
    return tuple(p.q.shape[4 - p.orig_ndim :])


def check_index(what: str, idx: Index, n: int, axis: str, device: torch.device) -> Tensor:
    """``rows=`` / ``heads=`` as a 1-D int64 tensor of valid, non-negative positions."""
    if idx is None:
        return torch.arange(n, device=device)
    if isinstance(idx, bool):
        raise TypeError(f"{what} must be an int, a sequence of ints or an int tensor, got bool")
    if isinstance(idx, int):
        t = torch.tensor([idx])
    elif isinstance(idx, Tensor):
        if idx.is_floating_point() or idx.dtype == torch.bool or idx.ndim > 1:
            raise TypeError(
                f"{what} must be an int, a sequence of ints or a 1-D int tensor, got a tensor "
                f"of dtype {idx.dtype} and shape {list(idx.shape)}"
            )
        t = idx.reshape(-1).to(torch.int64).cpu()
    else:
        try:
            items = list(idx)
        except TypeError:
            raise TypeError(
                f"{what} must be an int, a sequence of ints or an int tensor, got "
                f"{type(idx).__name__}"
            ) from None
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise TypeError(f"{what} must contain ints, got {items!r}")
        t = torch.tensor(items, dtype=torch.int64)
    bad = t[(t < -n) | (t >= n)].tolist()
    if bad:
        rng = f"0..{n - 1} (or -{n}..-1)" if n else "none: the axis is empty"
        raise ValueError(f"{what} {bad} out of range: q has {n} {axis}, valid {rng}")
    return torch.where(t < 0, t + n, t).to(device)


def scores(
    p: Problem, lse: Tensor, heads: Tensor | None, rows: Tensor, k0: int, k1: int
) -> tuple[Tensor, Tensor]:
    """Scaled, score-modded scores and weights of ``rows`` × keys ``k0:k1``.

    ``heads`` ``None`` means every query head (computed per kv-head group, no copies of k).
    Returns ``scores [B, h, r, k1-k0]`` (``-inf`` where masked) and ``weights`` of the same
    shape, in the compute dtype.
    """
    cdt = p.compute_dtype
    g = p.groups
    kb = p.k[:, :, k0:k1].to(cdt)  # [B, Hkv, bk, D]
    if heads is None:
        qb = p.q[:, :, rows].to(cdt)  # [B, Hq, r, D]
        B, Hq, r, D = qb.shape
        s = qb.view(B, p.Hkv, g, r, D) @ kb.unsqueeze(2).transpose(-2, -1)  # [B, Hkv, g, r, bk]
        s = s.reshape(B, Hq, r, k1 - k0)  # [B, Hq, r, bk]: head h = kv head h // g, member h % g
        heads = torch.arange(p.Hq, device=p.device)
    else:
        qb = p.q[:, heads][:, :, rows].to(cdt)  # [B, h, r, D]
        s = qb @ kb[:, heads // g].transpose(-2, -1)  # [B, h, r, bk]
    s = s * p.scale
    at = ((0, p.B), heads, rows, (k0, k1))  # every batch, the heads and rows, the keys
    s = score_at(p.score, s, *at)
    allowed = mask_at(p.mask, *at, p.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    row_lse = lse[:, heads][:, :, rows].to(cdt).unsqueeze(-1)  # [B, h, r, 1]
    # lse = -inf: every key masked, every weight 0. A NaN (a NaN in q or k, or an lse that
    # says so) stays NaN: such a row must not look fully masked.
    dead = torch.isneginf(row_lse)
    w = torch.exp(s - torch.where(dead, torch.zeros_like(row_lse), row_lse))
    w = torch.where(dead | torch.isneginf(s), torch.zeros_like(w), w)
    return s, w


def weights(
    q: Tensor,
    k: Tensor,
    *,
    lse: Tensor,
    rows: Index = None,
    heads: Index = None,
    mask: MaskLike = None,
    score_mod: ScoreLike = None,
    scale: float | None = None,
) -> Tensor:
    """Exact attention weights of chosen query rows and heads, rebuilt from the lse.

    Equivalent to selecting ``[:, heads][:, :, rows]`` from the weights
    :func:`qkv.reference.attention` returns, but without forming the ``Lq × Lk`` matrix: the
    memory is ``O(B × heads × rows × Lk)``. Pass the same ``mask``, ``score_mod`` and ``scale``
    as the call that produced ``lse``.

    Args:
        q: queries ``[B, Hq, Lq, D]`` (or unbatched ``[Hq, Lq, D]`` / ``[Lq, D]``).
        k: keys ``[B, Hkv, Lk, D]``; query head ``h`` uses key head ``h // (Hq // Hkv)``.
        lse: ``[B, Hq, Lq]`` (unbatched: ``[Hq, Lq]`` / ``[Lq]``) from
            ``qkv.attention(..., return_lse=True)``, whichever backend computed it.
        rows: query positions (an int, a sequence of ints or a 1-D int tensor; negative counts
            from the end); ``None`` = every row.
        heads: query heads, as ``rows``; ``None`` = every head.
        mask, score_mod, scale: as in :func:`qkv.attention`.

    Returns:
        ``weights [B, h, r, Lk]`` (``[h, r, Lk]`` / ``[r, Lk]`` for unbatched inputs) in
        float32 (float64 for float64 inputs). Each row sums to 1, or is all 0 where every key
        is masked (``lse = -inf``), or is NaN where a NaN in ``q``, ``k`` or ``lse`` reaches it.

    Example::

        >>> import torch, qkv
        >>> q, k = torch.randn(1, 4, 100, 16), torch.randn(1, 2, 100, 16)
        >>> v = torch.randn(1, 2, 100, 16)
        >>> out, lse = qkv.attention(q, k, v, mask=qkv.causal, return_lse=True)
        >>> w = qkv.inspect.weights(q, k, lse=lse, rows=[5, 99], heads=0, mask=qkv.causal)
        >>> w.shape, round(float(w[0, 0, 0].sum()), 4)
        (torch.Size([1, 1, 2, 100]), 1.0)
    """
    p, lse4 = check_problem(q, k, lse, mask, score_mod, scale)
    h = check_index("heads", heads, p.Hq, "heads", p.device)
    r = check_index("rows", rows, p.Lq, "query rows", p.device)
    return p.restore(row_weights(p, lse4, h, r))


def row_weights(p: Problem, lse: Tensor, heads: Tensor, rows: Tensor) -> Tensor:
    """Whole rows ``[B, h, r, Lk]`` of weights, ``exp(s - lse)`` divided by its row sum.

    The division absorbs the rounding of ``lse``: the backend that computed it rounded its
    scores differently from this recomputation, and ``exp(s - lse)`` would sum to ``1 ± ~1e-6``.
    """
    _, e = scores(p, lse, heads, rows, 0, p.Lk)  # [B, h, r, Lk]
    z = e.sum(dim=-1, keepdim=True)  # [B, h, r, 1]: 1 up to rounding, 0 for fully masked rows
    return e / torch.where(z > 0, z, torch.ones_like(z))

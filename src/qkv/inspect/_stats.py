"""Attention statistics computed block by block from the lse, never forming ``Lq × Lk``.

Each ``block_q × block_k`` tile of weights is rebuilt exactly (see ``_weights``), folded into
the running statistics and dropped. The received mass needs each row block's tiles twice (once
to learn the rows' normalisers, once to add ``e / Z``): they are kept while a row block's tiles
fit in ``_TILE_CACHE`` elements (64 MiB of float32) and recomputed beyond that, so the memory is
bounded whatever the lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core.problem import Problem
from ..typing import MaskLike, ScoreLike
from ._weights import check_problem, scores

Tensor = torch.Tensor

# Tiles of 64 query rows x 512 keys (x all heads): small enough to stay in cache-sized chunks
# for a few heads, large enough that the Python loop is not the cost.
_BLOCK_Q, _BLOCK_K = 64, 512
# A row block's weight tiles are kept for the received-mass pass up to this many elements
# (64 MiB of float32); beyond it they are recomputed (twice the score work, same memory bound).
_TILE_CACHE = 1 << 24


@dataclass
class Stats:
    """Statistics of one attention call (batched shapes; unbatched inputs drop dims alike).

    Attributes:
        received: ``[B, Hq, Lk]`` attention mass each key receives, summed over query rows
            (divide by ``Lq`` for the mean).
        entropy: ``[B, Hq, Lq]`` entropy of each query row's weights in nats (0 for a row that
            puts all its weight on one key, or that is fully masked; ``log(n)`` for uniform
            attention over ``n`` keys).
        top_weights: ``[B, Hq, Lq, K]`` the K largest weights of each row, in decreasing order.
        top_keys: ``[B, Hq, Lq, K]`` int64 key positions of ``top_weights``; ``-1`` where the
            row has fewer than K keys with nonzero weight (masked keys are never listed).
    """

    received: Tensor
    entropy: Tensor
    top_weights: Tensor
    top_keys: Tensor


def stats(
    q: Tensor,
    k: Tensor,
    *,
    lse: Tensor,
    mask: MaskLike = None,
    score_mod: ScoreLike = None,
    scale: float | None = None,
    top_k: int = 5,
) -> Stats:
    """Received attention mass per key, entropy per row and top-k keys per row, blockwise.

    Equal to the same quantities computed from the full weights of
    :func:`qkv.reference.attention`, but the weights are rebuilt from ``lse`` one tile at a
    time, in bounded memory beyond the results (at most ``_TILE_CACHE`` elements of tiles).

    Args:
        q: queries ``[B, Hq, Lq, D]`` (or unbatched ``[Hq, Lq, D]`` / ``[Lq, D]``).
        k: keys ``[B, Hkv, Lk, D]``.
        lse: ``[B, Hq, Lq]`` from ``qkv.attention(..., return_lse=True)``.
        mask, score_mod, scale: as in :func:`qkv.attention` (the same as that call's).
        top_k: how many keys to list per row (at most ``Lk``).

    Returns:
        A :class:`Stats`; tensors are float32 (float64 for float64 inputs).

    Example::

        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 2, 300, 16)
        >>> out, lse = qkv.attention(q, k, v, mask=qkv.causal, return_lse=True)
        >>> s = qkv.inspect.stats(q, k, lse=lse, mask=qkv.causal, top_k=3)
        >>> s.top_keys.shape, round(float(s.received.sum()), 2)   # every row gives away 1
        (torch.Size([1, 2, 300, 3]), 600.0)
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    p, lse4 = check_problem(q, k, lse, mask, score_mod, scale)
    return stats_of_problem(p, lse4, top_k)


def stats_of_problem(
    p: Problem, lse: Tensor, top_k: int, *, block_q: int = _BLOCK_Q, block_k: int = _BLOCK_K
) -> Stats:
    """:func:`stats` on a validated problem and ``lse [B, Hq, Lq]``.

    Per block of query rows, one pass over the key blocks computes ``e = exp(s - lse)``, its
    row sum ``Z``, ``Σ e log e`` and the running top-k scores. ``Z`` is 1 up to the rounding of
    ``lse`` (the backend rounded its scores differently); dividing by it makes every statistic
    that of exactly normalised weights. The received mass needs ``e / Z`` per tile, so the
    row block's tiles are kept while they fit in ``_TILE_CACHE`` elements, else recomputed.
    """
    cdt, dev = p.compute_dtype, p.device
    B, Hq, Lq, Lk = p.shape
    K = min(top_k, Lk)
    # Sums accumulate in float64: a key's mass adds up Lq weights, and float32 summation noise
    # (~1e-7 x Lq) would otherwise exceed the error of the weights themselves.
    received = torch.zeros(B, Hq, Lk, dtype=torch.float64, device=dev)
    entropy = torch.zeros(B, Hq, Lq, dtype=torch.float64, device=dev)
    top_s = torch.full((B, Hq, Lq, K), float("-inf"), dtype=cdt, device=dev)
    top_i = torch.full((B, Hq, Lq, K), -1, dtype=torch.int64, device=dev)
    row_z = torch.zeros(B, Hq, Lq, 1, dtype=torch.float64, device=dev)
    for q0 in range(0, Lq, block_q):
        q1 = min(q0 + block_q, Lq)
        rows = torch.arange(q0, q1, device=dev)
        keep = B * Hq * (q1 - q0) * Lk <= _TILE_CACHE
        tiles: list[Tensor] = []
        z = torch.zeros(B, Hq, q1 - q0, 1, dtype=torch.float64, device=dev)
        e_log_e = torch.zeros(B, Hq, q1 - q0, dtype=torch.float64, device=dev)
        run_s, run_i = top_s[:, :, q0:q1], top_i[:, :, q0:q1]  # [B, Hq, bq, K]
        for k0 in range(0, Lk, block_k):
            k1 = min(k0 + block_k, Lk)
            s, e = scores(p, lse, None, rows, k0, k1)  # [B, Hq, bq, bk] each
            z += e.sum(dim=-1, keepdim=True, dtype=torch.float64)
            e_log_e += torch.special.xlogy(e, e).sum(dim=-1, dtype=torch.float64)
            if keep:
                tiles.append(e)
            if K:
                # Weights are monotone in the scores within a row, so rank by score: exact,
                # and it keeps masked keys (-inf) below every allowed one.
                idx = torch.arange(k0, k1, device=dev).expand_as(s)
                cand_s = torch.cat([run_s, s], dim=-1)  # [B, Hq, bq, K + bk]
                cand_i = torch.cat([run_i, idx], dim=-1)
                run_s, pos = cand_s.topk(K, dim=-1)  # [B, Hq, bq, K]
                run_i = cand_i.gather(-1, pos)
        top_s[:, :, q0:q1], top_i[:, :, q0:q1] = run_s, run_i
        # Rows with no allowed key keep zero weight everywhere; a NaN row (NaN in q or k) has
        # Z NaN and stays NaN in every statistic instead of passing for an empty row.
        dead = z == 0
        inv_z = torch.where(dead, 0.0, 1 / torch.where(dead, 1.0, z))  # [B, Hq, bq, 1]
        row_z[:, :, q0:q1] = z
        # H = -Σ w log w with w = e / Z  =  -Σ e log e / Z + log Z
        ent = -e_log_e * inv_z[..., 0] + torch.where(dead, 1.0, z).log()[..., 0]
        ent = ent.clamp_min(0.0)  # H >= 0; rounding can leave -1e-15 for a one-key row
        entropy[:, :, q0:q1] = torch.where(dead[..., 0], 0.0, ent)
        for j, k0 in enumerate(range(0, Lk, block_k)):
            k1 = min(k0 + block_k, Lk)
            e = tiles[j] if keep else scores(p, lse, None, rows, k0, k1)[1]
            received[..., k0:k1] += (e * inv_z).sum(dim=2, dtype=torch.float64)
    row_lse = lse.to(cdt).unsqueeze(-1)  # [B, Hq, Lq, 1]
    empty = torch.isneginf(row_lse) | torch.isneginf(top_s) | (row_z == 0)  # (NaN is not)
    top_e = torch.exp(top_s - torch.where(empty, 0.0, row_lse))
    top_w = torch.where(empty, 0.0, top_e / torch.where(empty, 1.0, row_z)).to(cdt)
    top_i = torch.where(empty | (top_w == 0), -1, top_i)
    return Stats(
        received=p.restore(received.to(cdt)),
        entropy=p.restore(entropy.to(cdt)),
        top_weights=p.restore(top_w),
        top_keys=p.restore(top_i),
    )

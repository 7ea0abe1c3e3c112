"""A mask and a score_mod at *global* positions, for one (query chunk, key chunk) pair.

Each partial call of :func:`qkv.attention` sees local indices ``i`` (a query of the chunk
starting at global position ``qa``) and ``j`` (a key of the chunk starting at ``ka``); a
user's mask_mod and score_mod are written for global positions, so they are evaluated at
``(qa + i, ka + j)``: the same shift :mod:`qkv._positions` makes for a KV cache. Bands
(``qkv.causal``, ``qkv.sliding_window``) stay analytic bands, so each pair still reaches the
fastest kernel for its structure (and a band covering the whole pair is no mask at all);
bool tensors and bias tensors spanning the full ``[L, L]`` are sliced.
"""

from __future__ import annotations

import torch

from .._core.kinds import MaskKind, ScoreKind
from .._positions import MaskAt, ScoreAt, shift_band
from ..typing import MaskLike, ScoreLike

Tensor = torch.Tensor


def _slice(t: Tensor, q: tuple[int, int], k: tuple[int, int]) -> Tensor:
    """Rows ``q`` and columns ``k`` of a 4-D tensor over ``[.., L, L]`` (dims of 1 stay)."""
    rows = slice(*q) if t.shape[2] > 1 else slice(None)
    cols = slice(*k) if t.shape[3] > 1 else slice(None)
    return t[:, :, rows, cols]


def mask_for(m: MaskKind, q: tuple[int, int], k: tuple[int, int], L: int) -> MaskLike:
    """The ``mask=`` of the partial call over queries ``[q0, q1)`` and keys ``[k0, k1)``."""
    if m.is_none:
        return None
    if m.tensor is not None:
        return _slice(m.tensor, q, k)
    lq, lk = q[1] - q[0], k[1] - k[0]
    if m.is_band:
        return shift_band(m, q[0] - k[0], lq, lk)
    return MaskAt(m.mask_mod, q[0], k[0], L)


def score_for(s: ScoreKind, q: tuple[int, int], k: tuple[int, int], L: int) -> ScoreLike:
    """The ``score_mod=`` of the same partial call."""
    if s.is_none:
        return None
    if s.bias is not None:
        return _slice(s.bias, q, k)
    return ScoreAt(s.score_mod, q[0], k[0], L)

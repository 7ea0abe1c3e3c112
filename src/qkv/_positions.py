"""Masks and score_mods at absolute positions, for attention over a KV cache.

Under a cache the attention call sees *buffer* indices: query ``i`` of the new chunk and key
slot ``j`` of the cache. A user's mask_mod / score_mod is written for *absolute* sequence
positions (``qkv.causal`` means "key position <= query position"), so the module wraps it:

    q_abs  = q_idx + q_offset             (the new queries sit at the end of the sequence)
    kv_abs = kv_idx + kv_offset           (a full cache: kv_offset = 0)
    kv_abs = ring position of slot kv_idx (a sliding-window ring buffer)

For a full cache holding 3 tokens and a chunk of 2 new ones (``Lq=2``, ``Lk=5``, so
``q_offset = Lk - Lq = 3``), ``qkv.causal`` at absolute positions is, rows = queries::

    1 1 1 1 0        query at position 3 sees keys 0..3
    1 1 1 1 1        query at position 4 sees keys 0..4

while ``qkv.causal`` on the raw buffer indices (top-left aligned, like SDPA's ``is_causal``)
would wrongly give ``1 0 0 0 0`` / ``1 1 0 0 0``.

Band masks (``qkv.causal``, ``qkv.sliding_window``) are shifted analytically into another
band (so backends still see a known structure, and a band that covers every key becomes no
mask at all: single-token decoding runs unmasked); anything else is wrapped.
"""

from __future__ import annotations

from typing import Any

import torch

from ._core.checks import callable_name
from ._core.kinds import MaskKind, band, classify_score
from ._door import mask_kind
from .typing import MaskLike, ScoreLike

Tensor = torch.Tensor


class RingPositions:
    """Absolute position of each slot of a ring buffer of ``window`` slots whose newest entry
    is position ``last``: slot ``s`` holds the largest ``p <= last`` with ``p % window == s``."""

    def __init__(self, last: int, window: int) -> None:
        self.last, self.window = last, window

    def __call__(self, kv_idx: Tensor) -> Tensor:
        wraps = torch.div(self.last - kv_idx, self.window, rounding_mode="floor")
        return kv_idx + self.window * wraps


KvPos = int | RingPositions


def _kv_abs(kv_pos: KvPos, kv_idx: Tensor) -> Tensor:
    return kv_idx + kv_pos if isinstance(kv_pos, int) else kv_pos(kv_idx)


class MaskAt:
    """``mod`` evaluated at absolute positions (see the module docstring)."""

    def __init__(self, mod: Any, q_offset: int, kv_pos: KvPos, total: int) -> None:
        self.mod, self.q_offset, self.kv_pos, self.total = mod, q_offset, kv_pos, total

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.mod(b, h, q_idx + self.q_offset, _kv_abs(self.kv_pos, kv_idx))

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        check = getattr(self.mod, "_check_problem", None)
        if check is not None:  # the mod sees a sequence of `total` absolute positions
            check(B, H, self.total, self.total)

    def __repr__(self) -> str:
        return f"{callable_name(self.mod)} at absolute positions (queries from {self.q_offset})"

    @property
    def __name__(self) -> str:
        return repr(self)


class ScoreAt(MaskAt):
    def __call__(  # type: ignore[override]
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return self.mod(score, b, h, q_idx + self.q_offset, _kv_abs(self.kv_pos, kv_idx))


def band_covers(m: MaskKind, lo: int, hi: int) -> bool:
    """True if the band ``m`` allows every offset ``kv_abs - q_abs`` in ``[lo, hi]``."""
    return m.is_band and (m.lo is None or m.lo <= lo) and (m.hi is None or m.hi >= hi)


def shift_band(m: MaskKind, d: int, Lq: int, Lk: int) -> MaskLike:
    """The band ``m`` over absolute offsets as a band over buffer offsets ``j - i`` when
    ``kv_abs - q_abs = (j - i) - d``; ``None`` when it lets every pair of ``[Lq, Lk]`` through.
    A prefill (``d = 0``) of ``qkv.causal`` stays causal, so it reaches SDPA's ``is_causal``."""
    lo = None if m.lo is None else m.lo + d
    hi = None if m.hi is None else m.hi + d
    if (lo is None or lo <= -(Lq - 1)) and (hi is None or hi >= Lk - 1):
        return None
    return band(lo, hi, f"{m.name} at absolute positions (shifted by {d})").mask_mod


def mask_at(mask: MaskLike, q_offset: int, kv_pos: KvPos, Lq: int, Lk: int) -> MaskLike:
    """The mask to give :func:`qkv.attention` over the buffer ``[Lq, Lk]``."""
    kind = mask_kind(mask)
    if kind.is_none or kind.tensor is not None:
        return mask  # a tensor already spans the buffer's [Lq, Lk]
    if kind.is_band and isinstance(kv_pos, int):
        return shift_band(kind, q_offset - kv_pos, Lq, Lk)
    return MaskAt(kind.mask_mod, q_offset, kv_pos, q_offset + Lq)


def score_at(score_mod: ScoreLike, q_offset: int, kv_pos: KvPos, Lq: int) -> ScoreLike:
    """The score_mod to give :func:`qkv.attention` over the buffer ``[Lq, Lk]``."""
    if not classify_score(score_mod).is_callable:
        return score_mod  # a bias already spans the buffer's [Lq, Lk]
    return ScoreAt(score_mod, q_offset, kv_pos, q_offset + Lq)

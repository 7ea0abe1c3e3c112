"""Masks and scores evaluated over a region of the ``[B, Hq, Lq, Lk]`` score grid.

Every layer that needs a mask's or a score's values at some positions (the reference and
SDPA on the whole grid, tile planning tile by tile, the block-sparse engine piece by piece,
the Triton lists on partial tiles, qkv.inspect on a few rows, qkv.distributed's probe) asks
here. A region is one :data:`Axis` per dim of the grid: a contiguous range, which a tensor
mask or bias is *sliced* by (a view, no copy: the common case and the hot one), or 1-D
positions, which it is *gathered* at. A mask_mod or score_mod is called with the
broadcastable int64 index tensors of the region and its result checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .checks import check_mask_result, check_score_result
from .kinds import MaskKind, ScoreKind
from .lru import LRU

Tensor = torch.Tensor

# One dim of a region: positions ``lo .. hi-1`` as ``(lo, hi)``, or 1-D int64 positions.
Axis = tuple[int, int] | Tensor

_ALL = slice(None)
_NO_CUT = (_ALL, _ALL, _ALL, _ALL)


def whole(shape: tuple[int, ...]) -> tuple[Axis, Axis, Axis, Axis]:
    """The region of the whole grid ``[B, Hq, Lq, Lk]`` (``shape``, 4 sizes)."""
    B, H, Lq, Lk = shape
    return (0, B), (0, H), (0, Lq), (0, Lk)


def size(a: Axis) -> int:
    """How many positions an axis holds."""
    return a[1] - a[0] if isinstance(a, tuple) else a.numel()


def positions(a: Axis, device: torch.device) -> Tensor:
    """An axis as 1-D int64 positions ``[n]`` on ``device``."""
    return torch.arange(a[0], a[1], device=device) if isinstance(a, tuple) else a.to(device)


def grid(
    b: Axis, h: Axis, q: Axis, k: Axis, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The index tensors mods are called with: int64 ``b [nb, 1, 1, 1]``, ``h [1, nh, 1, 1]``,
    ``q_idx [1, 1, nq, 1]``, ``kv_idx [1, 1, 1, nk]``."""
    return (
        positions(b, device).view(-1, 1, 1, 1),
        positions(h, device).view(1, -1, 1, 1),
        positions(q, device).view(1, 1, -1, 1),
        positions(k, device).view(1, 1, 1, -1),
    )


def take(t: Tensor, b: Axis, h: Axis, q: Axis, k: Axis) -> Tensor:
    """``t``, 4-D and broadcastable to ``[B, Hq, Lq, Lk]``, at a region: ``[nb|1, nh|1,
    nq|1, nk|1]``. Dims of size 1 stay 1 (they broadcast); ranges are sliced (a view),
    positions gathered (a copy)."""
    n0, n1, n2, n3 = t.shape
    # Every range in one indexing call, written out: this runs once per tile of the
    # block-sparse engine, and each indexing call costs microseconds.
    cut = (
        slice(*b) if n0 > 1 and isinstance(b, tuple) else _ALL,
        slice(*h) if n1 > 1 and isinstance(h, tuple) else _ALL,
        slice(*q) if n2 > 1 and isinstance(q, tuple) else _ALL,
        slice(*k) if n3 > 1 and isinstance(k, tuple) else _ALL,
    )
    if cut != _NO_CUT:
        t = t[cut]
    ranges = isinstance(b, tuple) and isinstance(h, tuple) and isinstance(q, tuple)
    if not (ranges and isinstance(k, tuple)):
        for dim, a, n in ((0, b, n0), (1, h, n1), (2, q, n2), (3, k, n3)):
            if n > 1 and not isinstance(a, tuple):
                t = t.index_select(dim, a.to(t.device))
    return t


# Whole grids' index tensors, kept between eager calls: building the four (four `arange`s
# and four views) took ~17 us of a small call with a mask_mod (~200 us). Each entry holds the
# tensors' in-place versions: a mod that writes into its index tensors gets new ones.
_GRIDS: LRU[tuple[object, ...], tuple[tuple[Tensor, ...], tuple[int, ...]]] = LRU(64)


def kept_grid(
    b: Axis, h: Axis, q: Axis, k: Axis, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`grid`, kept between calls for a region of ranges from 0 (a whole grid) outside
    torch.compile's tracing; any other region is built anew."""
    if (
        not (isinstance(b, tuple) and isinstance(h, tuple))
        or not (isinstance(q, tuple) and isinstance(k, tuple))
        or b[0] or h[0] or q[0] or k[0]
        or torch.compiler.is_compiling()
    ):  # fmt: skip
        return grid(b, h, q, k, device)
    key = (b[1], h[1], q[1], k[1], device)
    got = _GRIDS.get(key)
    if got is not None:
        ts, versions = got
        if all(t._version == v for t, v in zip(ts, versions, strict=True)):
            return ts  # type: ignore[return-value]
    with torch.inference_mode(False):  # (inference tensors keep no version to check)
        made = grid(b, h, q, k, device)
    _GRIDS.put(key, (made, tuple(t._version for t in made)))
    return made


def call_mask_mod(
    mod: Callable[..., Any], b: Tensor, h: Tensor, q: Tensor, k: Tensor, shape: tuple[int, ...]
) -> Tensor:
    """A mask_mod called with index tensors that broadcast to ``shape``, its result checked:
    bool, 4-D, broadcastable to ``shape``."""
    return check_mask_result(mod(b, h, q, k), mod, shape)


def mask_at(m: MaskKind, b: Axis, h: Axis, q: Axis, k: Axis, device: torch.device) -> Tensor | None:
    """The mask at a region, bool ``[nb|1, nh|1, nq|1, nk|1]`` (True = may attend), or
    ``None`` for no mask: a bool tensor taken there (:func:`take`), a mask_mod called on
    the region's index tensors (on ``device``) and its result checked."""
    if m.is_none:
        return None
    if m.tensor is not None:
        return take(m.tensor, b, h, q, k)
    shape = (size(b), size(h), size(q), size(k))
    return call_mask_mod(m.mask_mod, *kept_grid(b, h, q, k, device), shape)


def score_at(
    sc: ScoreKind,
    s: Tensor,
    b: Axis,
    h: Axis,
    q: Axis,
    k: Axis,
    *,
    call: Callable[..., Any] | None = None,
    check: bool = True,
) -> Tensor:
    """Scores ``s [nb, nh, nq, nk]`` of a region with the score applied: a bias taken there
    and added in ``s``'s dtype, or the score_mod called on the region's index tensors and its
    result checked (broadcastable to ``s``, cast to ``s``'s dtype).

    ``call(s, b, h, q_idx, kv_idx)``, when given, calls the score_mod in its place (the
    block-sparse engine's first call watches what the output depends on); ``check=False``
    returns what the score_mod returned as it is (qkv.distributed's probe only hashes it, and
    the call reports a bad result with its own error)."""
    if sc.bias is not None:
        return s + take(sc.bias, b, h, q, k).to(s.dtype)
    mod = sc.score_mod
    if mod is None:
        return s
    out = (call or mod)(s, *kept_grid(b, h, q, k, s.device))
    return check_score_result(out, mod, tuple(s.shape), s.dtype) if check else out

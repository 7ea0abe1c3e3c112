"""What the Triton kernels read of a mask: the block lists of its tile plan, the built-in
masks' parameters, and the bits of partial tiles for every other mask.

:func:`mask_spec` classifies a :class:`qkv._core.kinds.MaskKind` once into the kernel's mask
formula (an and of a band, a prefix, a key range per batch element and document ids: every
built-in mask and their and-combinations) or into ``bits`` (any or-combination, bool tensor or
mask_mod: its partial tiles are evaluated here in PyTorch, packed 32 positions to an int32).

:func:`tile_lists` turns a block mask's states at one tiling into the kernel's lists: per
query block the key blocks it sees, and the transpose for the dK/dV kernel, each entry tagged
-1 (full) or with its partial tile's slot in the bits. They are built once per (block mask,
tiling, device) and kept on the block mask, so a block mask reused across layers is listed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._core.evaluate import call_mask_mod
from ..._core.kinds import MaskKind
from ..._core.kindspec import Unwatched, value_token
from ..._core.lru import LRU
from ..._core.tiles import EMPTY, EVAL_BUDGET, PARTIAL
from ..._core.value import Value
from ...blockmask import BlockMask, build

Tensor = torch.Tensor


@dataclass(frozen=True)
class MaskSpec:
    """The kernel's mask formula for one problem (``None`` / False = that term is off)."""

    band: tuple[int, int] | None = None  # lo <= kv - q <= hi
    prefix: int | None = None  # kv < prefix or kv <= q
    pad: tuple[Tensor, Tensor] | None = None  # (start [B], limit [B]) int32: start <= kv < limit
    ids: Tensor | None = None  # document ids [1 or B, L] int32 (one row shared, or per batch)
    bits: bool = False  # partial tiles read precomputed bits
    text: str = "no mask"

    @property
    def ids_stride(self) -> int:
        """Elements between batch elements' rows of ids: 0 when one row serves every one."""
        return 0 if self.ids is None or self.ids.shape[0] == 1 else self.ids.shape[1]

    def flags(self) -> dict[str, bool]:
        return {
            "HAS_BAND": self.band is not None,
            "HAS_PREFIX": self.prefix is not None,
            "HAS_PAD": self.pad is not None,
            "HAS_DOC": self.ids is not None,
            "HAS_BITS": self.bits,
        }


def mask_spec(m: MaskKind, B: int, Lq: int, Lk: int, device: torch.device) -> MaskSpec:
    """The kernel's formula for mask ``m`` (see the module docstring). A built-in mask with
    tensors keeps its formula under its value, as its plan (:func:`block_mask_at`): its
    tensors are copied to the device once, not in every layer's call (a pageable copy to a
    GPU waits for it)."""
    if m.is_none:
        return MaskSpec()
    key = _value_key(m, B, Lq, Lk, str(device))
    if key is None:
        return _mask_spec(m, B, Lq, Lk, device)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _mask_spec(m, B, Lq, Lk, device)
        _SPECS.put(key, spec)
    return spec


# Kernel formulas of built-in masks with tensors (their tensors on the device), by value.
_SPECS: LRU[tuple[object, ...], MaskSpec] = LRU(64)


def _value_key(m: MaskKind, *where: object) -> tuple[object, ...] | None:
    """``m``'s value (its signature token: numbers, tensors by identity and version) with
    ``where``, as a cache key; ``None`` for a mask that is not a built-in value throughout."""
    mod = m.mask_mod
    token = value_token(mod) if isinstance(mod, Value) else None
    if token is None or isinstance(token, Unwatched):
        return None
    return (token, *where)


def _mask_spec(m: MaskKind, B: int, Lq: int, Lk: int, device: torch.device) -> MaskSpec:
    t = m.terms
    if len(t.rest) > 0:  # an or, a tensor, a mask_mod, or a second term of one kind: bits
        return MaskSpec(bits=True, text=f"{m.name}, its partial tiles as precomputed bits")
    band: tuple[int, int] | None = None
    pad: tuple[Tensor, Tensor] | None = None
    ids: Tensor | None = None
    words: list[str] = []
    if t.band is not None:
        b_lo, b_hi = t.band
        lo = -(Lq + 1) if b_lo is None else max(b_lo, -(Lq + 1))
        hi = Lk + 1 if b_hi is None else min(b_hi, Lk + 1)
        band = (lo, hi)
        words.append(f"band {b_lo} <= kv - q <= {b_hi}")
    if t.prefix is not None:
        words.append(f"kv < {t.prefix} or causal")
    if t.keys is not None:
        start, lim = t.keys.per_batch(B, torch.int32)
        pad = (start.to(device), lim.to(device))
        words.append("start[b] <= kv < limit[b]")
    if t.ids is not None:
        ids = t.ids.to(device=device, dtype=torch.int32).contiguous()  # [1 or B, L]
        words.append("ids[q] == ids[kv]" if ids.shape[0] == 1 else "ids[b, q] == ids[b, kv]")
    return MaskSpec(band=band, prefix=t.prefix, pad=pad, ids=ids, text=" and ".join(words))


@dataclass(frozen=True)
class TileLists:
    """One tiling's lists on one device (shapes in the module docstring)."""

    block_size: tuple[int, int]
    kv_num: Tensor  # [Bm, Hm, nq] int32: key blocks each query block sees
    kv_idx: Tensor  # [Bm, Hm, nq, Wk] int32
    kv_tag: Tensor  # [Bm, Hm, nq, Wk] int32: -1 full, else the bits slot
    q_num: Tensor  # [Bm, Hm, nk] int32: query blocks that see each key block
    q_idx: Tensor  # [Bm, Hm, nk, Wq]
    q_tag: Tensor  # [Bm, Hm, nk, Wq]
    bits: Tensor  # [T, bq, bk // 32] int32 (one dummy tile when no mask needs bits)
    states: Tensor  # [Bm, Hm, nq, nk] int8, on the CPU

    @property
    def broadcast(self) -> tuple[int, int]:
        return self.kv_num.shape[0], self.kv_num.shape[1]


def block_mask_at(
    m: MaskKind,
    shape: tuple[int, int, int, int],
    block_size: tuple[int, int],
    device: torch.device,
) -> BlockMask:
    """The tile plan of ``m`` at ``block_size``: the given block mask when it was built at this
    tiling, its tiles cut finer when its tiling is a multiple of this one (no position is
    evaluated again: a full or empty tile's quarters are full or empty), else planned anew."""
    given = m.block
    if isinstance(given, BlockMask):
        if given.block_size == block_size:
            return given
        (gq, gk), (bq, bk) = given.block_size, block_size
        if gq % bq == 0 and gk % bk == 0:
            key = ("triton-refined", block_size)
            got = given.schedules.get(key)
            if got is None:
                got = _refined(given, block_size)
                given.schedules.put(key, got)
            return got
    return _planned(m, shape, block_size, device)


# Tile plans of built-in masks, kept by the mask's value (its signature token: its numbers,
# and its tensors by identity and in-place version), so a model calling qkv.causal, a window
# or one padding mask in every layer plans it once per shape; the least recently used goes.
_PLANS: LRU[tuple[object, ...], BlockMask] = LRU(64)


def _planned(
    m: MaskKind, shape: tuple[int, int, int, int], block_size: tuple[int, int], device: torch.device
) -> BlockMask:
    key = _value_key(m, shape, block_size, str(device))
    if key is None:  # a user's mod in it (or a bool tensor): planned at each call
        return build(m, shape, (False, False), block_size, device)
    bm = _PLANS.get(key)
    if bm is None:
        bm = build(m, shape, (False, False), block_size, device)
        _PLANS.put(key, bm)
    return bm


def _refined(given: BlockMask, block_size: tuple[int, int]) -> BlockMask:
    (gq, gk), (bq, bk) = given.block_size, block_size
    _, _, Lq, Lk = given.shape
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    states = given.states.repeat_interleave(gq // bq, dim=2).repeat_interleave(gk // bk, dim=3)
    states = states[:, :, :nq, :nk].contiguous()
    return BlockMask(
        kind=given.kind,
        shape=given.shape,
        broadcast=given._broadcast,
        block_size=block_size,
        states=states,
        evaluated=given.evaluated,
        device=given.device,
    )


def tile_lists(
    bm: BlockMask,
    m: MaskKind,
    spec: MaskSpec,
    shape: tuple[int, int, int, int],
    device: torch.device,
) -> TileLists:
    """The kernel's lists for block mask ``bm`` (cached on it, per device)."""
    key = ("triton-lists", bm.block_size, str(device))
    got = bm.schedules.get(key)
    if got is None:
        got = _lists(bm, m, spec, shape, device)
        bm.schedules.put(key, got)
    return got


def _sorted_visible(vis: Tensor) -> tuple[Tensor, Tensor]:
    """``(count [..., n], idx [..., n, W])``: per row the visible column indices, increasing
    (entries past a row's count are 0). A scatter by running count: 2-3x faster than a
    stable sort at 256 x 1024 tiles (n = 32 K), where planning cost more than the kernel."""
    count = vis.sum(-1)
    width = int(count.max()) if count.numel() else 0
    if vis.shape[-1] == 0:  # no columns at all (no keys): empty lists
        return count, torch.zeros((*vis.shape[:-1], 0), dtype=torch.int64)
    width = max(1, width)
    slot = torch.where(vis, vis.cumsum(-1) - 1, width)  # [..., n]: each visible column's place
    cols = torch.arange(vis.shape[-1]).expand(vis.shape)
    out = torch.zeros((*vis.shape[:-1], width + 1), dtype=torch.int64)
    out.scatter_(-1, slot, cols)  # hidden columns all land in the spare last slot
    return count, out[..., :width]


def _lists(
    bm: BlockMask,
    m: MaskKind,
    spec: MaskSpec,
    shape: tuple[int, int, int, int],
    device: torch.device,
) -> TileLists:
    states = bm.states.cpu()
    bq, bk = bm.block_size
    vis = states != EMPTY
    slots = torch.full(states.shape, -1, dtype=torch.int64)
    partial = states == PARTIAL
    n_partial = int(partial.sum())
    slots[partial] = torch.arange(n_partial) if spec.bits else 0
    bits = (
        _bits(m, states, shape, bm.block_size, device)
        if spec.bits and n_partial
        else torch.zeros(1, bq, max(1, bk // 32), dtype=torch.int32, device=device)
    )
    kv_num, kv_idx = _sorted_visible(vis)
    kv_tag = torch.gather(slots, -1, kv_idx)
    vis_t = vis.transpose(-1, -2)
    q_num, q_idx = _sorted_visible(vis_t)
    q_tag = torch.gather(slots.transpose(-1, -2), -1, q_idx)

    def dev(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=torch.int32).contiguous()

    return TileLists(
        block_size=(bq, bk),
        kv_num=dev(kv_num),
        kv_idx=dev(kv_idx),
        kv_tag=dev(kv_tag),
        q_num=dev(q_num),
        q_idx=dev(q_idx),
        q_tag=dev(q_tag),
        bits=bits,
        states=states,
    )


def _bits(
    m: MaskKind,
    states: Tensor,
    shape: tuple[int, int, int, int],
    block_size: tuple[int, int],
    device: torch.device,
) -> Tensor:
    """The mask on every partial tile, in slot order (row-major over ``states``), packed into
    int32 words ``[T, bq, bk // 32]``; evaluated ``EVAL_BUDGET`` positions at a time."""
    _, _, Lq, Lk = shape
    bq, bk = block_size
    where = (states == PARTIAL).nonzero()  # [T, 4]: b, h, qb, kb (row-major = slot order)
    ev = device if m.tensor is None else m.tensor.device
    rows = torch.arange(bq, device=ev)
    cols = torch.arange(bk, device=ev)
    shifts = torch.arange(32, dtype=torch.int64, device=ev)
    chunk = max(1, EVAL_BUDGET // (bq * bk))
    out = []
    for start in range(0, where.shape[0], chunk):
        w = where[start : start + chunk].to(ev)
        t = w.shape[0]
        b = w[:, 0].view(t, 1, 1, 1)
        h = w[:, 1].view(t, 1, 1, 1)
        q = w[:, 2].view(t, 1, 1, 1) * bq + rows.view(1, 1, bq, 1)  # [T, 1, bq, 1]
        k = w[:, 3].view(t, 1, 1, 1) * bk + cols.view(1, 1, 1, bk)  # [T, 1, 1, bk]
        inside = (q < Lq) & (k < Lk)
        # One (b, h, tile) per row of t: scattered tiles, so index tensors rather than a
        # region; positions past the lengths are clamped to real ones and masked off.
        qc, kc = q.clamp(max=Lq - 1), k.clamp(max=Lk - 1)
        allowed = call_mask_mod(m.mask_mod, b, h, qc, kc, (t, 1, bq, bk))
        allowed = (allowed & inside).expand(t, 1, bq, bk).reshape(t, bq, bk // 32, 32)
        words = (allowed.to(torch.int64) << shifts).sum(-1)  # [T, bq, bk // 32] in [0, 2^32)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words)
        out.append(words.to(device=device, dtype=torch.int32))
    return torch.cat(out).contiguous()


__all__ = ["MaskSpec", "TileLists", "block_mask_at", "mask_spec", "tile_lists"]

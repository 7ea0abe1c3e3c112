"""A FlexAttention ``BlockMask`` (``torch.nn.attention.flex_attention.create_block_mask``) as
a :class:`qkv.BlockMask`.

FlexAttention lists, per ``(b, h)`` and query block, the key blocks to compute with its
mask_mod (``kv_num_blocks`` / ``kv_indices``, "partial") and those to compute unmasked
(``full_kv_num_blocks`` / ``full_kv_indices``). That is exactly qkv's empty / partial / full
tile states, so the lists become the int8 grid ``[B|1, H|1, nq, nk]`` unchanged, and what may
attend is what FlexAttention computes::

    allowed(b, h, i, j) = state[b, h, i // bq, j // bk] == full
                          or (state == partial and mask_mod(b, h, i, j))

The mask_mod is vmap-style (FlexAttention evaluates it under vmap), so it goes through
:func:`qkv._flex.compat.mask_mod_convention`. Lengths need not be block multiples:
FlexAttention pads the last blocks with "masked" when it builds them, so those are partial
and their mask_mod is evaluated at the real positions only.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from .._core.evaluate import call_mask_mod
from .._core.kinds import classify_mask
from .._core.tiles import DEFAULT_BLOCK, EMPTY, FULL, PARTIAL
from ..blockmask import BlockMask
from .compat import _FLEX, mask_mod_convention

Tensor = torch.Tensor

# FlexAttention block sizes up to this are kept as qkv's tiles; larger ones (its "no mask"
# BlockMask uses 2**30) are re-tiled at qkv's 128, since the engine computes a whole tile at
# once (B * H * bq * bk scores) and a 2**30 tile would be the whole score matrix.
_MAX_BLOCK = 2 * DEFAULT_BLOCK
# Converted masks, per FlexAttention BlockMask: FlexAttention reuses one across layers, so
# qkv reuses the conversion and the schedules cached on it.
_converted: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], BlockMask]] = (
    weakref.WeakKeyDictionary()
)


class _FlexMaskMod:
    """What a FlexAttention BlockMask lets through, as a mask_mod (see the module docstring)."""

    def __init__(self, states: Tensor, block: tuple[int, int], mod: Any) -> None:
        self.states = states  # int8 [B|1, H|1, nq, nk] at FlexAttention's block size
        self.block = block
        self.mod = mod
        # (while dynamo traces, a value cannot be read: the mod is evaluated, as if partial)
        self.any_partial = torch.compiler.is_compiling() or bool((states == PARTIAL).any())

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        s, (bq, bk) = self.states, self.block
        st = s[
            b if s.shape[0] > 1 else 0, h if s.shape[1] > 1 else 0, q_idx // bq, kv_idx // bk
        ]  # broadcast of the index shapes, e.g. [B, H, rows, keys]
        allowed = st == FULL
        if self.any_partial:
            shape = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
            m = call_mask_mod(self.mod, b, h, q_idx, kv_idx, shape)
            allowed = allowed | ((st == PARTIAL) & m)
        return allowed

    @property
    def __name__(self) -> str:
        return f"FlexAttention BlockMask of {getattr(self.mod, '__name__', 'its mask_mod')}"


def _dense(num: Tensor, idx: Tensor, nk: int, value: int) -> Tensor:
    """FlexAttention's ordered lists (``num [..., nq]``, ``idx [..., nq, max]``) as an int8
    grid ``[..., nq, nk]`` holding ``value`` at the listed blocks."""
    valid = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)  # [..., nq, max]
    cols = torch.where(valid & (idx < nk), idx, nk).long()  # unlisted -> a spill column
    out = torch.zeros(*idx.shape[:-1], nk + 1, dtype=torch.int8)
    out.scatter_(-1, cols, value)
    return out[..., :nk]


def _retile(states: Tensor, dim: int, L: int, old: int, new: int) -> tuple[Tensor, Tensor]:
    """Min and max state over the ``old`` blocks each ``new``-sized tile of ``dim`` covers
    (``new <= old``: at most two)."""
    start = torch.arange(-(-L // new)) * new
    lo = start // old
    hi = ((start + new).clamp(max=L) - 1) // old
    a, b = states.index_select(dim, lo), states.index_select(dim, hi)
    return torch.minimum(a, b), torch.maximum(a, b)


def _qkv_tiles(states: Tensor, Lq: int, Lk: int, bq: int, bk: int) -> tuple[Tensor, int, int]:
    """The states at qkv tile sizes: FlexAttention's when they fit, else 128 (exact: a tile is
    empty where all it covers is, full where all is, else partial)."""
    mn = mx = states
    if bq > _MAX_BLOCK:
        mn, _ = _retile(mn, 2, Lq, bq, DEFAULT_BLOCK)
        _, mx = _retile(mx, 2, Lq, bq, DEFAULT_BLOCK)
        bq = DEFAULT_BLOCK
    if bk > _MAX_BLOCK:
        mn, _ = _retile(mn, 3, Lk, bk, DEFAULT_BLOCK)
        _, mx = _retile(mx, 3, Lk, bk, DEFAULT_BLOCK)
        bk = DEFAULT_BLOCK
    if mn is states:
        return states, bq, bk
    return (mx > EMPTY).to(torch.int8) + (mn == FULL).to(torch.int8), bq, bk


def from_flex_block_mask(
    fbm: Any, B: int, H: int, Lq: int, Lk: int, *, device: torch.device
) -> BlockMask:
    """The :class:`qkv.BlockMask` computing what FlexAttention computes with ``fbm`` on a
    ``[B, H, Lq, Lk]`` problem (``H`` = query heads); ``ValueError`` if it was built for
    another problem."""
    flex = sys.modules[_FLEX]  # loaded: fbm is one of its BlockMasks
    tracing = torch.compiler.is_compiling()  # converted in the graph, nothing kept
    lists = (fbm.kv_num_blocks, fbm.kv_indices, fbm.full_kv_num_blocks, fbm.full_kv_indices)
    key: tuple[Any, ...] = (B, H, Lq, Lk, str(device), fbm.mask_mod, fbm.BLOCK_SIZE)
    if not tracing:
        key += (fbm.seq_lengths, *((t, t._version) for t in lists if t is not None))  # edits
        hit = _converted.get(fbm)
        if hit is not None and _same(hit[0], key):
            return hit[1]
    bq, bk = (int(x) for x in fbm.BLOCK_SIZE)
    large = getattr(flex, "_LARGE_SPARSE_BLOCK_SIZE", 1 << 30)
    build = (
        f"build it for this problem with create_block_mask(mask_mod, B={B}, H={H}, "
        f"Q_LEN={Lq}, KV_LEN={Lk}, device={str(device)!r})"
    )
    if fbm.mask_mod is getattr(flex, "_sliced_mask_mod_error", None):
        raise ValueError(f"this FlexAttention BlockMask was sliced and has no mask_mod; {build}")
    # FlexAttention's own "no mask" BlockMask (one 2**30 block) fits any length, as there.
    if (bq, bk) != (large, large) and tuple(fbm.seq_lengths) != (Lq, Lk):
        raise ValueError(
            f"this FlexAttention BlockMask was built for Q_LEN={fbm.seq_lengths[0]}, "
            f"KV_LEN={fbm.seq_lengths[1]} but the problem has Lq={Lq}, Lk={Lk}; {build}"
        )
    num, idx = fbm.kv_num_blocks, fbm.kv_indices
    while idx.ndim < 4:  # [.., nq, max] with batch and head dims of 1 left out
        num, idx = num.unsqueeze(0), idx.unsqueeze(0)
    Bm, Hm, nq_m = idx.shape[:3]
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    if Bm not in (1, B) or Hm not in (1, H) or nq_m < nq:
        raise ValueError(
            f"this FlexAttention BlockMask has block lists for B={Bm}, H={Hm} and {nq_m} query "
            f"blocks of {bq}, but the problem has B={B}, H={H} (query heads) and "
            f"{nq} query blocks (Lq={Lq}); {build}"
        )
    if fbm.kv_num_blocks.device != device:
        raise ValueError(
            f"this FlexAttention BlockMask is on {fbm.kv_num_blocks.device} but q is on "
            f"{device}; build it with device={str(device)!r}"
        )
    states = _dense(num.cpu(), idx.cpu(), nk, PARTIAL)
    if fbm.full_kv_indices is not None:
        fnum, fidx = fbm.full_kv_num_blocks, fbm.full_kv_indices
        fnum, fidx = fnum.reshape(*num.shape), fidx.reshape(*num.shape, -1)
        states = torch.maximum(states, _dense(fnum.cpu(), fidx.cpu(), nk, FULL))
    states = states[:, :, :nq].contiguous()  # [Bm, Hm, nq, nk]
    mod = fbm.mask_mod
    if mod is getattr(flex, "noop_mask", None):
        states = torch.where(states == PARTIAL, FULL, states)  # it lets everything through
    else:
        mod = mask_mod_convention(mod, B, H, Lq, Lk, device)  # called with every b and h
    tiles, tq, tk = _qkv_tiles(states, Lq, Lk, bq, bk)
    bm = BlockMask(
        kind=classify_mask(_FlexMaskMod(states.to(device), (bq, bk), mod)),
        shape=(B if Bm > 1 else 1, H if Hm > 1 else 1, Lq, Lk),
        broadcast=(Bm == 1, Hm == 1),
        block_size=(tq, tk),
        states=tiles.contiguous(),
        evaluated=[],
        device=device,
    )
    if not tracing:
        _converted[fbm] = (key, bm)
    return bm


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b or (not isinstance(a, Tensor) and not isinstance(b, Tensor) and a == b)

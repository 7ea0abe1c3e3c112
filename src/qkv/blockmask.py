"""Block masks: which (query block, key block) tiles a mask lets through, planned once.

The score matrix ``[B, H, Lq, Lk]`` is cut into tiles of ``bq x bk`` positions. A tile is

- **empty** when the mask hides all of it: the block-sparse engine never touches it;
- **full** when the mask allows all of it: computed with no masking at all;
- **partial** otherwise: the mask is evaluated for that tile alone when it is computed.

Built-in masks (:data:`qkv.causal`, :func:`qkv.sliding_window`, :func:`qkv.document`,
:func:`qkv.padding`, :func:`qkv.prefix_lm` and their :func:`qkv.and_masks` /
:func:`qkv.or_masks` combinations) are classified analytically from their structure in
O(number of tiles) work, never evaluating a position. Arbitrary mask_mods and bool tensors
are evaluated tile by tile in bounded memory. A :class:`BlockMask` is reusable: build it once
and pass it as ``mask=`` to every layer of a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._flexcompat import adopt_mask as _adopt_mask
from ._validate import _as_4d, _broadcastable, check_mask_result, index_tensors

Tensor = torch.Tensor

__all__ = ["BlockMask", "block_mask"]

EMPTY, PARTIAL, FULL = 0, 1, 2

DEFAULT_BLOCK = 128
# Positions evaluated per mask_mod call when a mask has no analytic rule: bounds the memory a
# mask_mod's temporaries can take (an int64 intermediate of this many elements is 32 MiB).
_EVAL_BUDGET = 1 << 22


class _Grid:
    """The tiling of a ``[B, H, Lq, Lk]`` score matrix into ``bq x bk`` blocks.

    Built-in masks' ``_block_states(grid)`` read the block bounds from here and call
    :meth:`from_ranges` / :meth:`classify`.
    """

    def __init__(
        self, B: int, H: int, Lq: int, Lk: int, bq: int, bk: int, device: torch.device
    ) -> None:
        self.B, self.H, self.Lq, self.Lk, self.bq, self.bk = B, H, Lq, Lk, bq, bk
        self.device = device
        self.nq, self.nk = -(-Lq // bq), -(-Lk // bk)
        self.q_start = torch.arange(self.nq, dtype=torch.int64) * bq  # [nq] first row
        self.q_last = (self.q_start + bq).clamp(max=Lq) - 1  # [nq] last row
        self.k_start = torch.arange(self.nk, dtype=torch.int64) * bk  # [nk] first key
        self.k_last = (self.k_start + bk).clamp(max=Lk) - 1  # [nk] last key
        self.evaluated: list[str] = []  # names of mask_mods that had to be evaluated

    def from_ranges(
        self, vis_lo: Tensor, vis_hi: Tensor, full_lo: Tensor, full_hi: Tensor
    ) -> Tensor:
        """States from per-row ranges of key-block indices: blocks ``vis_lo..vis_hi`` are
        visible and, among them, ``full_lo..full_hi`` full. Each bound is ``[..., R]`` (``R``
        query blocks or 1); the result is int8 ``[..., R, nk]`` left-padded to 4 dims."""
        j = torch.arange(self.nk, dtype=torch.int64)  # [nk]

        def within(lo: Tensor, hi: Tensor) -> Tensor:
            return (j >= lo.unsqueeze(-1)) & (j <= hi.unsqueeze(-1))  # [..., R, nk]

        vis = within(vis_lo, vis_hi)
        states = vis.to(torch.int8) + (vis & within(full_lo, full_hi)).to(torch.int8)
        while states.ndim < 4:
            states = states.unsqueeze(0)
        return states

    def classify(self, mod: Any) -> Tensor:
        """int8 states broadcastable to ``[B, H, nq, nk]`` for a mask_mod or bool tensor."""
        rule = getattr(mod, "_block_states", None)
        if rule is not None and not isinstance(mod, Tensor):
            states = rule(self)
            if states is not None:
                return states
        self.evaluated.append(_name(mod))
        return _evaluate(mod, self)


def _name(mod: Any) -> str:
    if isinstance(mod, Tensor):
        return f"bool tensor {list(mod.shape)}"
    return getattr(mod, "__name__", None) or type(mod).__name__


def _tile_rows(g: _Grid) -> tuple[int, int]:
    """Rows and columns per evaluation tile (multiples of the block sizes) within the budget."""
    bh = g.B * g.H
    cols = g.nk * g.bk
    rows = max(g.bq, (_EVAL_BUDGET // max(1, bh * cols)) // g.bq * g.bq)
    if bh * g.bq * cols > _EVAL_BUDGET:  # even one block row is too wide: split the keys too
        cols = max(g.bk, (_EVAL_BUDGET // (bh * g.bq)) // g.bk * g.bk)
    return rows, cols


def _evaluate(mod: Any, g: _Grid) -> Tensor:
    """Evaluate a mask_mod (or slice a bool tensor) tile by tile and reduce each block to
    empty / partial / full. Memory is bounded by ``_EVAL_BUDGET`` positions per tile."""
    if g.device.type == "meta" or (isinstance(mod, Tensor) and mod.device.type == "meta"):
        # No data to evaluate (qkv.plan on meta tensors): every block may hold anything.
        return torch.ones(1, 1, g.nq, g.nk, dtype=torch.int8)
    if g.Lq == 0 or g.Lk == 0:
        return torch.zeros(1, 1, g.nq, g.nk, dtype=torch.int8)
    rows, cols = _tile_rows(g)
    states: Tensor | None = None
    for r0 in range(0, g.Lq, rows):
        r1 = min(g.Lq, r0 + rows)
        for c0 in range(0, g.Lk, cols):
            c1 = min(g.Lk, c0 + cols)
            if isinstance(mod, Tensor):  # 4-D, dims of 1 broadcast
                rs = slice(r0, r1) if mod.shape[2] > 1 else slice(None)
                cs = slice(c0, c1) if mod.shape[3] > 1 else slice(None)
                m = mod[:, :, rs, cs]
            else:
                b, h, qi, ki = index_tensors(g.B, g.H, (r0, r1), (c0, c1), g.device)
                shape = (g.B, g.H, r1 - r0, c1 - c0)
                m = check_mask_result(mod(b, h, qi, ki), mod, shape)
            tile = _reduce_tile(m, r1 - r0, c1 - c0, g.bq, g.bk).cpu()  # [b', h', nrb, ncb]
            if states is None or states.shape[:2] != tile.shape[:2]:
                lead = (
                    tile.shape[:2]
                    if states is None
                    else torch.broadcast_shapes(states.shape[:2], tile.shape[:2])
                )
                new = torch.zeros(*lead, g.nq, g.nk, dtype=torch.int8)
                if states is not None:
                    new.copy_(states.expand_as(new))
                states = new
            states[
                :,
                :,
                r0 // g.bq : r0 // g.bq + tile.shape[2],
                c0 // g.bk : c0 // g.bk + tile.shape[3],
            ] = tile
    if states is None:  # Lq == 0 or Lk == 0
        return torch.zeros(1, 1, g.nq, g.nk, dtype=torch.int8)
    return states


def _reduce_tile(m: Tensor, rows: int, cols: int, bq: int, bk: int) -> Tensor:
    """``m [b', h', rows|1, cols|1]`` bool → int8 states ``[b', h', rows/bq, cols/bk]``
    (rounded up)."""
    m = m.expand(m.shape[0], m.shape[1], rows, cols)
    nr, nc = -(-rows // bq), -(-cols // bk)
    pr, pc = nr * bq - rows, nc * bk - cols
    if pr or pc:
        # Positions past the lengths are not real: they must not make a block "any" visible
        # nor stop it from being "all" full, so reduce "any" over False and "all" over True.
        anym = torch.nn.functional.pad(m, (0, pc, 0, pr), value=False)
        allm = torch.nn.functional.pad(m, (0, pc, 0, pr), value=True)
    else:
        anym = allm = m
    lead = m.shape[:2]
    anyb = anym.reshape(*lead, nr, bq, nc, bk).any(dim=5).any(dim=3)  # [b', h', nr, nc]
    allb = allm.reshape(*lead, nr, bq, nc, bk).all(dim=5).all(dim=3)
    return anyb.to(torch.int8) + allb.to(torch.int8)


class _TensorMaskMod:
    """A bool tensor ``[B|1, H|1, Lq|1, Lk|1]`` seen as a mask_mod (for dense materialisation)."""

    def __init__(self, t: Tensor) -> None:
        self.t = t

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        t = self.t
        idx = [
            i if n > 1 else torch.zeros_like(i)
            for i, n in zip((b, h, q_idx, kv_idx), t.shape, strict=True)
        ]
        return t[idx[0], idx[1], idx[2], idx[3]]

    @property
    def __name__(self) -> str:
        return f"bool tensor {list(self.t.shape)}"


@dataclass(frozen=True)
class _Row:
    """The schedule for one query block: the key blocks it sees, and which need a mask."""

    q0: int
    q1: int
    blocks: tuple[int, ...]  # visible key-block indices, increasing
    partial: tuple[bool, ...]  # True where that key block needs element-wise masking


class BlockMask:
    """A mask planned at block level for one ``[B, H, Lq, Lk]`` problem shape.

    Build with :func:`qkv.block_mask`. Pass it as ``mask=`` to :func:`qkv.attention` (any
    backend) as often as you like: the planning is done once.

    Attributes:
        shape: ``(B, H, Lq, Lk)`` it was built for (``B``/``H`` of 1 broadcast).
        block_size: ``(bq, bk)``.
        states: int8 ``[B|1, H|1, nq, nk]``, 0 = empty, 1 = partial, 2 = full (on the CPU).
        mask_mod: the mask as a mask_mod, for backends that materialise it densely.
    """

    def __init__(
        self,
        *,
        mask: Any,
        shape: tuple[int, int, int, int],
        broadcast: tuple[bool, bool],
        block_size: tuple[int, int],
        states: Tensor,
        evaluated: list[str],
        device: torch.device,
    ) -> None:
        self.mask = mask
        self.mask_mod: Callable[..., Tensor] = (
            _TensorMaskMod(mask) if isinstance(mask, Tensor) else mask
        )
        self.shape = shape
        self._broadcast = broadcast
        self.block_size = block_size
        self.states = states
        self.evaluated = evaluated
        self.device = device
        self._rows: list[_Row] | None = None

    # -- what the planner and the engine read --------------------------------------------

    @property
    def num_blocks(self) -> dict[str, int]:
        """Counts of ``full``, ``partial`` and ``empty`` tiles over all (b, h) planned."""
        s = self.states
        full = int((s == FULL).sum())
        partial = int((s == PARTIAL).sum())
        return {"full": full, "partial": partial, "empty": s.numel() - full - partial}

    def block_density(self) -> float:
        """Fraction of score positions inside visible (full or partial) tiles: the share of
        the dense work the block-sparse engine does. An upper bound on the mask's density."""
        Lq, Lk = self.shape[2], self.shape[3]
        if Lq * Lk == 0:
            return 0.0
        bq, bk = self.block_size
        g = _Grid(1, 1, Lq, Lk, bq, bk, torch.device("cpu"))
        rows = (g.q_last - g.q_start + 1).double()  # [nq]
        cols = (g.k_last - g.k_start + 1).double()  # [nk]
        area = rows.view(-1, 1) * cols.view(1, -1)  # [nq, nk] positions per tile
        vis = (self.states > EMPTY).double().mean(dim=(0, 1))  # [nq, nk] share of (b, h)
        return float((vis * area).sum()) / (Lq * Lk)

    def rows(self) -> list[_Row]:
        """Per query block, the key blocks any (b, h) sees; a block is unmasked only where it
        is full for every (b, h). Cached."""
        if self._rows is None:
            self._rows = _schedule(self.states, self.shape[2], self.block_size[0])
        return self._rows

    # -- validation hook (qkv._validate calls it for anything passed as mask=) ------------

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        mB, mH, mLq, mLk = self.shape
        bad = []
        if (mLq, mLk) != (Lq, Lk):
            bad.append(f"lengths Lq={mLq}, Lk={mLk} (the problem has Lq={Lq}, Lk={Lk})")
        if mB != B and not (self._broadcast[0] and mB == 1):
            bad.append(f"batch {mB} (the problem has {B})")
        if mH != H and not (self._broadcast[1] and mH == 1):
            bad.append(f"{mH} heads (the problem has {H})")
        if bad:
            raise ValueError(
                f"this block mask was built for {', '.join(bad)}; build one for this problem "
                f"with qkv.block_mask(mask, B={B}, H={H}, Lq={Lq}, Lk={Lk}) (B=None / H=None "
                f"build one for every batch size / head count when the mask ignores b / h)"
            )

    @property
    def __name__(self) -> str:
        return repr(self)

    def __repr__(self) -> str:
        B, H, Lq, Lk = self.shape
        n = self.num_blocks
        total = self.states.numel()
        bq, bk = self.block_size
        return (
            f"BlockMask({_name(self.mask_mod)}, B={B}, H={H}, Lq={Lq}, Lk={Lk}, block {bq}x{bk}: "
            f"{total - n['empty']}/{total} tiles visible ({n['partial']} partial), "
            f"block density {self.block_density():.1%})"
        )

    def to_string(self, max_blocks: int = 48) -> str:
        """The tile grid of the first (b, h): ``#`` full, ``+`` partial, ``.`` empty."""
        s = self.states[0, 0]
        step_q = max(1, -(-s.shape[0] // max_blocks))
        step_k = max(1, -(-s.shape[1] // max_blocks))
        chars = {EMPTY: ".", PARTIAL: "+", FULL: "#"}
        lines = [repr(self)]
        for i in range(0, s.shape[0], step_q):
            row = s[i, ::step_k].tolist()
            lines.append("".join(chars[int(x)] for x in row))
        return "\n".join(lines)


def _schedule(states: Tensor, Lq: int, bq: int) -> list[_Row]:
    vis = (states > EMPTY).any(dim=1).any(dim=0)  # [nq, nk]: seen by some (b, h)
    full = (states == FULL).all(dim=1).all(dim=0)  # [nq, nk]: unmasked for every (b, h)
    counts = vis.sum(dim=1).tolist()
    ii, jj = vis.nonzero(as_tuple=True)
    cols = jj.tolist()
    part = (~full[ii, jj]).tolist()
    out, at = [], 0
    for i, c in enumerate(counts):
        out.append(
            _Row(i * bq, min(Lq, (i + 1) * bq), tuple(cols[at : at + c]), tuple(part[at : at + c]))
        )
        at += c
    return out


def _check_block_size(block_size: object) -> tuple[int, int]:
    if block_size is None:
        return DEFAULT_BLOCK, DEFAULT_BLOCK
    sizes = block_size if isinstance(block_size, tuple) else (block_size, block_size)
    if len(sizes) != 2 or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes
    ):
        raise ValueError(
            f"block_size must be a positive int or a (q_block, kv_block) pair of them, got "
            f"{block_size!r}; None picks {DEFAULT_BLOCK}"
        )
    return int(sizes[0]), int(sizes[1])


def _check_dims(B: object, H: object, Lq: object, Lk: object) -> tuple[int, int, int, int]:
    out = []
    for name, val, none_ok in (
        ("B", B, True),
        ("H", H, True),
        ("Lq", Lq, False),
        ("Lk", Lk, False),
    ):
        if val is None and none_ok:
            out.append(1)
            continue
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            extra = " or None (the same mask for every one)" if none_ok else ""
            raise ValueError(f"block_mask {name} must be an int >= 0{extra}, got {val!r}")
        out.append(val)
    return out[0], out[1], out[2], out[3]


def block_mask(
    mask: Any,
    B: int | None,
    H: int | None,
    Lq: int,
    Lk: int,
    *,
    block_size: int | tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> BlockMask:
    """Plan a mask at block level once, to reuse it across calls and layers.

    Args:
        mask: a mask_mod ``(b, h, q_idx, kv_idx) -> bool`` (built-in masks and their
            ``and_masks`` / ``or_masks`` combinations are planned analytically, others are
            evaluated tile by tile in bounded memory) or a bool tensor broadcastable to
            ``[B, H, Lq, Lk]``.
        B, H: batch size and query heads, or ``None`` when the mask is the same for every
            batch element / head (it is then planned once and broadcast, as in FlexAttention's
            ``create_block_mask``).
        Lq, Lk: query and key lengths.
        block_size: tile size ``bq`` (or ``(bq, bk)``); default 128. Lengths need not be
            multiples of it.
        device: where an arbitrary mask_mod is evaluated (default: the bool tensor's device,
            else the CPU). The plan itself lives on the CPU.

    Returns:
        A :class:`BlockMask` to pass as ``mask=`` to :func:`qkv.attention`.

    Example::

        >>> import torch, qkv
        >>> bm = qkv.block_mask(qkv.sliding_window(256), None, None, 4096, 4096)
        >>> q = k = v = torch.randn(1, 8, 4096, 64)
        >>> out = qkv.attention(q, k, v, mask=bm)    # reuse bm in every layer
        >>> bm.num_blocks["empty"] > bm.num_blocks["full"]
        True
    """
    if isinstance(mask, BlockMask):
        return mask
    bq, bk = _check_block_size(block_size)
    b_, h_, lq, lk = _check_dims(B, H, Lq, Lk)
    if isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(
                f"block_mask needs a bool tensor (True = may attend) or a mask_mod, got a "
                f"{mask.dtype} tensor"
            )
        if not _broadcastable(tuple(mask.shape), (b_, h_, lq, lk)):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to [B, H, Lq, Lk] = "
                f"{[b_, h_, lq, lk]}"
            )
        mask = _as_4d(mask)
        dev = torch.device(device) if device is not None else mask.device
    elif callable(mask):
        check = getattr(mask, "_check_problem", None)
        if check is not None:
            check(b_, h_, lq, lk)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        mask = _adopt_mask(mask, dev, (b_, h_, lq, lk), lazy=True)  # vmap-only mask_mods
    else:
        raise TypeError(
            f"block_mask needs a mask_mod (b, h, q_idx, kv_idx) -> bool or a bool tensor, got "
            f"{type(mask).__name__}"
        )
    g = _Grid(b_, h_, lq, lk, bq, bk, dev)
    states = g.classify(mask)
    states = states.expand(
        b_ if states.shape[0] > 1 else 1, h_ if states.shape[1] > 1 else 1, g.nq, g.nk
    ).contiguous()
    return BlockMask(
        mask=mask,
        shape=(b_, h_, lq, lk),
        broadcast=(B is None, H is None),
        block_size=(bq, bk),
        states=states,
        evaluated=g.evaluated,
        device=dev,
    )


def for_problem(p: Any, block_size: int | tuple[int, int] | None = None) -> BlockMask | None:
    """The block mask for a validated problem (built once and cached on it), or ``None`` when
    the problem has no mask."""
    m = p.mask
    if m is None:
        return None
    if isinstance(m, BlockMask):
        return m
    cache = p.__dict__.setdefault("_qkv_block_masks", {})
    if block_size not in cache:
        cache[block_size] = block_mask(
            m, p.B, p.Hq, p.Lq, p.Lk, block_size=block_size, device=p.device
        )
    bm: BlockMask = cache[block_size]
    return bm

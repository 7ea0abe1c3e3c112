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

from ._core.checks import as_4d, broadcastable
from ._core.kinds import MaskKind, classify_mask
from ._core.lru import LRU
from ._core.tiles import DEFAULT_BLOCK, EMPTY, FULL, PARTIAL, Grid, classify
from ._flex.compat import adopt_mask

Tensor = torch.Tensor

__all__ = ["BlockMask", "block_mask"]


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
        mask: what it was built from (a bool tensor right-aligned to 4 dims).
        kind: the mask classified (:class:`qkv._core.kinds.MaskKind`), with this plan attached.
    """

    def __init__(
        self,
        *,
        kind: MaskKind,
        shape: tuple[int, int, int, int],
        broadcast: tuple[bool, bool],
        block_size: tuple[int, int],
        states: Tensor,
        evaluated: list[str],
        device: torch.device,
    ) -> None:
        self.kind = kind.with_block(self)
        self.mask: Any = kind.tensor if kind.tensor is not None else kind.source
        self.mask_mod: Callable[..., Tensor] = kind.mask_mod
        self.shape = shape
        self._broadcast = broadcast
        self.block_size = block_size
        self.states = states
        self.evaluated = evaluated
        self.device = device
        self._rows: list[_Row] | None = None
        # The block-sparse engine's schedules of this plan, by their parameters: a block mask
        # reused across calls and layers is scheduled once (backends/blocksparse/schedule.py).
        self.schedules: LRU[tuple[Any, ...], Any] = LRU(16)

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
        g = Grid(1, 1, Lq, Lk, bq, bk, torch.device("cpu"))
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

    # -- validation (qkv._door calls it for a block mask passed as mask=) ---------------

    def check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
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
            f"BlockMask({self.kind.name}, B={B}, H={H}, Lq={Lq}, Lk={Lk}, block {bq}x{bk}: "
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
        if not broadcastable(tuple(mask.shape), (b_, h_, lq, lk)):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to [B, H, Lq, Lk] = "
                f"{[b_, h_, lq, lk]}"
            )
        mask = as_4d(mask)
        dev = torch.device(device) if device is not None else mask.device
    elif callable(mask):
        check = getattr(mask, "_check_problem", None)  # built-ins check their own dims
        if check is not None:
            check(b_, h_, lq, lk)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        mask = adopt_mask(mask, dev, (b_, h_, lq, lk), lazy=True)  # vmap-only mask_mods
    else:
        raise TypeError(
            f"block_mask needs a mask_mod (b, h, q_idx, kv_idx) -> bool or a bool tensor, got "
            f"{type(mask).__name__}"
        )
    return build(classify_mask(mask), (b_, h_, lq, lk), (B is None, H is None), (bq, bk), dev)


def build(
    kind: MaskKind,
    shape: tuple[int, int, int, int],
    broadcast: tuple[bool, bool],
    block_size: tuple[int, int],
    device: torch.device,
) -> BlockMask:
    """The block mask of a classified mask (the engine builds one per call this way)."""
    b_, h_, lq, lk = shape
    bq, bk = block_size
    g = Grid(b_, h_, lq, lk, bq, bk, device)
    states = classify(g, kind)
    states = states.expand(
        b_ if states.shape[0] > 1 else 1, h_ if states.shape[1] > 1 else 1, g.nq, g.nk
    ).contiguous()
    return BlockMask(
        kind=kind,
        shape=shape,
        broadcast=broadcast,
        block_size=block_size,
        states=states,
        evaluated=g.evaluated,
        device=device,
    )

"""The block-sparse engine's work list: which pieces of the score matrix to compute, how.

A *piece* is one query block against a run of its visible key blocks. Most query blocks are
one piece; a query block whose visible keys would need more than ``_PIECE_BUDGET`` scores at
once (long rows with a score_mod, or a mask over very many keys) is split into several pieces
whose results are merged by their log-sum-exp (the online softmax of FlashAttention).

A :class:`Job` holds everything the forward and backward kernels need besides q, k, v: the
pieces, the mask source, the score_mod or bias, dropout seeds, and which kernel family runs.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._validate import Problem, check_mask_result, check_score_result, index_tensors
from ..blockmask import DEFAULT_BLOCK, BlockMask, block_mask, for_problem
from ..masks import _And, _Band, _Document, _KvBelow, _Or

Tensor = torch.Tensor

# Scores (or float-mask entries) one piece may hold at once: 4 Mi elements = 16 MiB in
# float32. Bounds the engine's extra memory whatever the sequence length (DESIGN.md: no path
# silently needs O(n²) memory).
_PIECE_BUDGET = 1 << 22


@dataclass
class Piece:
    """One query block ``[q0, q1)`` against the keys ``runs`` (contiguous ``(k0, k1)`` key
    ranges, increasing). ``masked`` lists ``(offset, k0, k1)`` sub-ranges, at ``offset`` within
    the piece's keys, where the mask must be evaluated element-wise."""

    q0: int
    q1: int
    runs: list[tuple[int, int]]
    masked: list[tuple[int, int, int]]
    seed: int
    span: int = 0
    index: Tensor | None = None  # key positions [span] when the runs are not one range

    def __post_init__(self) -> None:
        self.span = sum(k1 - k0 for k0, k1 in self.runs)

    def keys(self, t: Tensor) -> Tensor:
        """``t [B, H, Lk, X]`` restricted to this piece's keys: a view for one run, a gather
        (copy) otherwise."""
        if len(self.runs) == 1:
            k0, k1 = self.runs[0]
            return t[:, :, k0:k1]
        assert self.index is not None
        return t.index_select(2, self.index.to(t.device))

    def key_positions(self, device: torch.device) -> Tensor:
        if len(self.runs) == 1:
            return torch.arange(*self.runs[0], device=device)
        assert self.index is not None
        return self.index.to(device)


class HiddenDependency(Exception):
    """A score_mod's output depends on a learnable tensor that inspection did not find."""


@dataclass
class BandGroup:
    """Query blocks ``i0 .. i0+n-1`` (all full-size) that see key blocks ``i+c .. i+c+w-1``
    with one and the same mask pattern (a band mask is translation invariant): one fused
    kernel call over strided views covers them all, with one ``[b, w*b]`` additive mask."""

    i0: int
    n: int
    c: int
    w: int
    b: int
    # (device, dtype) -> (additive mask [1, 1, b, w*b] or None, rows without keys [1, 1, b]
    # or None); evaluated once from the group's first row.
    masks: dict[tuple[torch.device, torch.dtype], tuple[Tensor | None, Tensor | None]] = field(
        default_factory=dict
    )


@dataclass
class Schedule:
    """Per query block its pieces (empty where a band group computes it), and the groups."""

    rows: list[list[Piece]]
    groups: list[BandGroup]


# A segment is one mask-free fused call: queries [q0, q1) against keys [k0, k1), causal
# (top-left aligned inside the segment) or not.
Segment = tuple[int, int, int, int, bool]


@dataclass
class Job:
    """Everything the kernels need for one call, besides the tensors."""

    p: Problem
    fused: bool  # torch's fused CPU flash kernel per piece (else explicit matmuls)
    segments: list[Segment]  # mask-free fused calls covering the problem (else empty)
    fwd: Schedule  # what the forward computes (pieces and band groups)
    mask_src: Any  # None, a 4-D bool tensor, or a mask_mod
    bias: Tensor | None  # 4-D float bias
    score_mod: Any  # callable or None
    seed: int  # dropout seed for this call (drawn from torch's default generator)
    mask_dims: tuple[int, int]  # (b', h') the mask varies over
    params: list[Tensor] = field(default_factory=list)  # tensors a score_mod closes over
    # Set for the first score_mod call of a call that may need gradients: given the score_mod's
    # output and its score input (under autograd), True if the output depends on a learnable
    # tensor the engine does not know about (see blocksparse.py).
    hidden_check: Callable[[Tensor, Tensor], bool] | None = None
    # The backward's schedule when it differs from the forward's (band masks: see make_job),
    # built on first use.
    bwd_build: Callable[[], Schedule] | None = None
    _bwd: Schedule | None = None

    @property
    def bwd(self) -> Schedule:
        if self.bwd_build is None:
            return self.fwd
        if self._bwd is None:
            self._bwd = self.bwd_build()
        return self._bwd

    # -- masks -------------------------------------------------------------------------

    def group_mask(
        self, g: BandGroup, device: torch.device, dtype: torch.dtype
    ) -> tuple[Tensor | None, Tensor | None]:
        """A band group's shared additive mask and its rows without keys, evaluated once
        (from the group's first row) per device and dtype."""
        got = g.masks.get((device, dtype))
        if got is not None:
            return got
        span = g.w * g.b
        q0, k0 = g.i0 * g.b, (g.i0 + g.c) * g.b
        b, h, qi, _ = index_tensors(1, 1, (q0, q0 + g.b), (0, 0), device)
        ki = torch.arange(k0, k0 + span, device=device).view(1, 1, 1, -1)  # [1, 1, 1, span]
        m = check_mask_result(self.mask_src(b, h, qi, ki), self.mask_src, (1, 1, g.b, span))
        m = m.expand(1, 1, g.b, span)
        fmask, dead = None, None
        if not bool(m.all()):
            fmask = torch.zeros(m.shape, dtype=dtype, device=device)
            fmask = fmask.masked_fill(~m, float("-inf"))
            rows_dead = ~m.any(dim=-1)  # [1, 1, b]
            dead = rows_dead if bool(rows_dead.any()) else None
        g.masks[(device, dtype)] = (fmask, dead)
        return fmask, dead

    def piece_mask(self, pc: Piece, device: torch.device) -> Tensor | None:
        """bool ``[b', h', q1-q0, span]`` (True = may attend) or ``None`` when every key of the
        piece is visible to every row. Only the partial key blocks are evaluated."""
        if not pc.masked or self.mask_src is None:
            return None
        rows = pc.q1 - pc.q0
        if (
            len(pc.masked) == 1
            and pc.masked[0][0] == 0
            and pc.masked[0][2] - pc.masked[0][1] == pc.span
        ):
            return self._eval(pc, pc.q0, pc.q1, None, device, rows)
        m = torch.ones(1, 1, rows, pc.span, dtype=torch.bool, device=device)
        for off, k0, k1 in pc.masked:
            r = self._eval(pc, pc.q0, pc.q1, (k0, k1), device, rows)
            lead = torch.broadcast_shapes(m.shape[:2], r.shape[:2])
            if tuple(m.shape[:2]) != tuple(lead):
                m = m.expand(*lead, rows, pc.span).clone()
            m[:, :, :, off : off + (k1 - k0)] = r
        return m

    def _eval(
        self,
        pc: Piece,
        q0: int,
        q1: int,
        krange: tuple[int, int] | None,
        device: torch.device,
        rows: int,
    ) -> Tensor:
        src = self.mask_src
        p = self.p
        if isinstance(src, Tensor):
            rs = slice(q0, q1) if src.shape[2] > 1 else slice(None)
            if src.shape[3] == 1:
                m = src[:, :, rs, :]
            elif krange is not None:
                m = src[:, :, rs, krange[0] : krange[1]]
            else:
                m = pc.keys(src[:, :, rs].transpose(2, 3)).transpose(2, 3)  # [b', h', rows, span]
            width = pc.span if krange is None else krange[1] - krange[0]
            return m.expand(m.shape[0], m.shape[1], rows, width)
        if krange is None:
            ki = pc.key_positions(device).view(1, 1, 1, -1)  # [1, 1, 1, span]
        else:
            ki = torch.arange(*krange, device=device).view(1, 1, 1, -1)  # [1, 1, 1, k1-k0]
        b, h, qi, _ = index_tensors(p.B, p.Hq, (q0, q1), (0, 0), device)
        shape = (p.B, p.Hq, rows, ki.shape[-1])
        m = check_mask_result(src(b, h, qi, ki), src, shape)
        return m.expand(m.shape[0], m.shape[1], rows, ki.shape[-1])

    # -- score_mod / bias ----------------------------------------------------------------

    def bias_slice(self, pc: Piece) -> Tensor | None:
        """The bias restricted to the piece: ``[Bb, Hb, rows|1, span|1]``."""
        bias = self.bias
        if bias is None:
            return None
        if bias.shape[2] > 1:
            bias = bias[:, :, pc.q0 : pc.q1]
        if bias.shape[3] > 1:
            bias = pc.keys(bias.transpose(2, 3)).transpose(2, 3)
        return bias

    def apply_score_mod(self, s: Tensor, pc: Piece) -> Tensor:
        """A callable score_mod on the piece's scores ``s [B, Hq, rows, span]``."""
        p = self.p
        b, h, qi, _ = index_tensors(p.B, p.Hq, (pc.q0, pc.q1), (0, 0), s.device)
        ki = pc.key_positions(s.device).view(1, 1, 1, -1)  # [1, 1, 1, span]
        check, self.hidden_check = self.hidden_check, None
        if check is None:
            out = self.score_mod(s, b, h, qi, ki)
        else:  # the first call: watch which learnable tensors the output depends on
            with torch.enable_grad():
                s_in = s.detach().requires_grad_(True)
                out = self.score_mod(s_in, b, h, qi, ki)
            if isinstance(out, Tensor) and check(out, s_in):
                raise HiddenDependency
            out = out.detach() if isinstance(out, Tensor) else out
        out = check_score_result(out, self.score_mod, tuple(s.shape), s.dtype)
        return out.expand(s.shape)

    def keep_mask(self, pc: Piece, shape: tuple[int, ...], device: torch.device) -> Tensor:
        """The dropout keep-pattern of a piece: the same in the forward and the backward."""
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed + 1_000_003 * pc.seed) % (1 << 63))
        return torch.rand(shape, generator=gen, device=device) >= self.p.dropout_p


def _causal_like(mask: Any) -> bool:
    return isinstance(mask, _Band) and mask.lo is None and mask.hi == 0


def _pieces(bm: BlockMask, max_span: int) -> list[list[Piece]]:
    """Split each query block's visible key blocks into pieces of at most ``max_span`` keys
    (at least one block each)."""
    Lk = bm.shape[3]
    bk = bm.block_size[1]
    out: list[list[Piece]] = []
    for i, row in enumerate(bm.rows()):
        pieces: list[Piece] = []
        chunk: list[tuple[int, bool]] = []
        width = 0
        for j, part in zip(row.blocks, row.partial, strict=True):
            w = min(Lk, (j + 1) * bk) - j * bk
            if chunk and width + w > max_span:
                pieces.append(_make_piece(row.q0, row.q1, chunk, bk, Lk, i, len(pieces)))
                chunk, width = [], 0
            chunk.append((j, part))
            width += w
        if chunk:
            pieces.append(_make_piece(row.q0, row.q1, chunk, bk, Lk, i, len(pieces)))
        out.append(pieces)
    return out


def _make_piece(
    q0: int, q1: int, blocks: list[tuple[int, bool]], bk: int, Lk: int, row: int, n: int
) -> Piece:
    runs: list[tuple[int, int]] = []
    masked: list[tuple[int, int, int]] = []
    off = 0
    for j, part in blocks:
        k0, k1 = j * bk, min(Lk, (j + 1) * bk)
        if runs and runs[-1][1] == k0:
            runs[-1] = (runs[-1][0], k1)
        else:
            runs.append((k0, k1))
        if part:
            if (
                masked
                and masked[-1][0] + (masked[-1][2] - masked[-1][1]) == off
                and masked[-1][2] == k0
            ):
                masked[-1] = (masked[-1][0], masked[-1][1], k1)
            else:
                masked.append((off, k0, k1))
        off += k1 - k0
    pc = Piece(q0, q1, runs, masked, seed=row * 4096 + n)
    if len(runs) > 1:
        pc.index = torch.cat([torch.arange(a, b) for a, b in runs])
    return pc


def fused_ok(p: Problem) -> str | None:
    """Why torch's fused CPU flash kernel cannot run this problem's pieces, or ``None``."""
    if p.device.type not in ("cpu", "meta"):  # meta: `qkv plan` describing a CPU run
        return f"tensors are on {p.device.type} (the fused flash kernel used here is CPU-only)"
    if p.score_mod is not None and not isinstance(p.score_mod, Tensor):
        return "a callable score_mod is applied block by block with explicit matmuls"
    if isinstance(p.score_mod, Tensor):
        if p.score_mod.requires_grad and torch.is_grad_enabled():
            return "the bias needs a gradient, which the fused kernel does not return"
        if p.dtype in (torch.float16, torch.bfloat16):
            return "the contract adds the bias in float32; the fused kernel adds it in q's dtype"
    if p.dropout_p > 0:
        return "dropout must use the same pattern in forward and backward (explicit matmuls)"
    if p.D == 0 or p.Dv == 0:
        return "a head dim is 0"
    return None


def make_job(
    p: Problem, *, block_size: int | tuple[int, int] | None = None, matmul: bool = False
) -> Job:
    """Plan one call: the block mask (built once, cached on the problem or the block mask),
    the pieces, and the kernel family (``matmul=True`` forces explicit matmuls)."""
    fused = fused_ok(p) is None and not matmul
    bias = p.score_mod if isinstance(p.score_mod, Tensor) else None
    score_mod = p.score_mod if callable(p.score_mod) and bias is None else None
    mask = p.mask
    mask_src = mask.mask if isinstance(mask, BlockMask) else mask
    seed = int(torch.randint(0, 1 << 62, (1,)).item()) if p.dropout_p > 0 else 0
    if fused and bias is None and p.Lk > 0:
        segments = _segments(p, mask_src)
        if segments:
            empty = Schedule([], [])
            return Job(p, True, segments, empty, None, None, None, seed, (1, 1))
    band = (
        fused
        and bias is None
        and isinstance(mask_src, _Band)
        and p.Hq == p.Hkv
        and not isinstance(mask, BlockMask)
        and block_size is None
    )
    if band:
        # Band masks depend on (lo, hi, lengths) only: their plans are cached by value, so a
        # model calling sliding_window(w) in every layer plans once. Measured
        # (benchmarks/RESULTS.md): the fused forward kernel runs a 256-wide window fastest
        # with 32-row blocks (less of each tile is masked off) while its backward prefers
        # 128; both are exact with the global out and lse, so each takes its own blocks.
        assert isinstance(mask_src, _Band)
        # The finer forward grid has 16x the tiles; past ~16 M of them (n ~ 128 K) the
        # int8 tile grid itself would cost more than it saves, so both use the default.
        fine = -(-p.Lq // _FWD_BAND_BLOCK) * -(-p.Lk // _FWD_BAND_BLOCK) <= 1 << 24
        b_fwd = _FWD_BAND_BLOCK if fine else DEFAULT_BLOCK
        fwd = _band_schedule(mask_src, p, b_fwd, fwd_only=True)
        job = Job(p, True, [], fwd, mask_src, None, None, seed, (1, 1))
        job.bwd_build = functools.partial(_band_schedule, mask_src, p, DEFAULT_BLOCK)
        return job
    bm = for_problem(p, block_size)
    if bm is None:  # no mask: one all-full plan
        bm = block_mask(_all_true, None, None, p.Lq, p.Lk, block_size=block_size)
        mask_src = None
    bq, bk = bm.block_size
    md = (bm.states.shape[0], bm.states.shape[1])
    per_key = bq * (md[0] * md[1] if fused and bias is None else p.B * p.Hq)
    max_span = max(1, _PIECE_BUDGET // max(1, per_key))
    grouped = fused and bias is None and isinstance(mask_src, _Band) and md == (1, 1)
    grouped = grouped and p.Hq == p.Hkv and bq == bk
    sched = _schedule(bm, max_span, bq if grouped else 0, _row_elems(p))
    return Job(p, fused, [], sched, mask_src, bias, score_mod, seed, md)


def _schedule(
    bm: BlockMask, max_span: int, group_b: int, row_elems: int, *, fwd_only: bool = False
) -> Schedule:
    """Pieces (and band groups of ``group_b`` blocks, if not 0) of a block mask, cached on
    it: a block mask reused across calls and layers is scheduled once."""
    cache = bm.__dict__.setdefault("_qkv_schedules", {})
    key = (max_span, group_b, row_elems, fwd_only)
    if key not in cache:
        rows = _pieces(bm, max_span)
        groups = _band_groups(rows, group_b, row_elems, fwd_only) if group_b else []
        cache[key] = Schedule(rows, groups)
    return cache[key]


def _band_schedule(mask: _Band, p: Problem, b: int, *, fwd_only: bool = False) -> Schedule:
    bm = _band_block_mask(mask.lo, mask.hi, p.Lq, p.Lk, b)
    max_span = max(1, _PIECE_BUDGET // b)
    return _schedule(bm, max_span, b, _row_elems(p), fwd_only=fwd_only)


# Band plans cached by value: (lo, hi, Lq, Lk, b) -> BlockMask (its schedules cached on it).
# Only small tile grids are kept (a grid is nq*nk bytes), and only the most recent few.
_BAND_CACHE: OrderedDict[tuple[Any, ...], BlockMask] = OrderedDict()
_BAND_CACHE_SIZE = 8
_BAND_CACHE_CELLS = 1 << 22


def _band_block_mask(lo: int | None, hi: int | None, Lq: int, Lk: int, b: int) -> BlockMask:
    key = (lo, hi, Lq, Lk, b)
    bm = _BAND_CACHE.get(key)
    if bm is not None:
        _BAND_CACHE.move_to_end(key)
        return bm
    bm = block_mask(_Band(lo, hi, f"band [{lo}, {hi}]"), None, None, Lq, Lk, block_size=b)
    if bm.states.numel() <= _BAND_CACHE_CELLS:
        _BAND_CACHE[key] = bm
        while len(_BAND_CACHE) > _BAND_CACHE_SIZE:
            _BAND_CACHE.popitem(last=False)
    return bm


_FWD_BAND_BLOCK = 32


def _row_elems(p: Problem) -> int:
    """Elements per (query or key) position across batch and heads, at the fused kernel's
    padded head dim: band-group calls are sized by it so that a call's largest output (the
    overlapping key-window gradients, in the backward) stays within ``_PIECE_BUDGET``."""
    return p.B * p.Hq * max(p.D, p.Dv, 1)


def _segments(p: Problem, mask: Any) -> list[Segment]:
    """Mask-free fused calls that compute the problem exactly, if there are any: the whole
    problem for no mask or causal (the kernel's ``is_causal`` is top-left aligned, as
    :data:`qkv.causal`); one call per document for sorted document ids (optionally with
    causal): documents are independent attention problems; and for ``prefix_lm(P)`` the
    prefix rows against the prefix, then the later rows against the prefix and, causally,
    against the rest (two calls over the same rows, merged by their lse). Segments over the
    same rows are adjacent in the list."""
    if mask is None or _causal_like(mask):
        return [(0, p.Lq, 0, p.Lk, mask is not None)]
    prefix = _prefix_length(mask)
    if prefix is not None:
        P = min(prefix, p.Lk)
        if P == 0:
            return [(0, p.Lq, 0, p.Lk, True)]
        segs: list[Segment] = [(0, min(P, p.Lq), 0, P, False)]
        if p.Lq > P:
            segs.append((P, p.Lq, 0, P, False))
            if p.Lk > P:  # rows r >= P see keys P..r: causal, top-left aligned at P
                segs.append((P, p.Lq, P, p.Lk, True))
        return segs
    if p.Lq != p.Lk:
        return []
    doc, causal = None, False
    if isinstance(mask, _Document):
        doc = mask
    elif isinstance(mask, _And) and len(mask.mods) == 2:
        a, b = mask.mods
        if _causal_like(a) and isinstance(b, _Document):
            doc, causal = b, True
        elif _causal_like(b) and isinstance(a, _Document):
            doc, causal = a, True
    if doc is None:
        return []
    ids = doc.ids.detach().to("cpu")[: p.Lq]
    if ids.numel() > 1 and not bool((ids[1:] >= ids[:-1]).all()):
        return []
    starts = [0, *(torch.nonzero(ids[1:] != ids[:-1]).view(-1) + 1).tolist()]
    if len(starts) > max(8, p.Lq // 128):  # many tiny documents: tiles do better
        return []
    ends = [*starts[1:], p.Lq]
    return [(a, b, a, b, causal) for a, b in zip(starts, ends, strict=True)]


def _prefix_length(mask: Any) -> int | None:
    """``P`` if ``mask`` is ``prefix_lm(P)`` (``kv_idx < P`` or causal), else ``None``."""
    if not isinstance(mask, _Or) or len(mask.mods) != 2:
        return None
    a, b = mask.mods
    if _causal_like(b) and isinstance(a, _KvBelow) and isinstance(a.limit, int):
        return a.limit
    if _causal_like(a) and isinstance(b, _KvBelow) and isinstance(b.limit, int):
        return b.limit
    return None


def _band_groups(
    rows: list[list[Piece]], b: int, row_elems: int, fwd_only: bool = False
) -> list[BandGroup]:
    """Batch consecutive query blocks whose pieces are the same band pattern shifted by one
    block each; their entries in ``rows`` are emptied (the group computes them)."""
    groups: list[BandGroup] = []

    def key(i: int) -> tuple[Any, ...] | None:
        pcs = rows[i]
        if len(pcs) != 1 or len(pcs[0].runs) != 1 or pcs[0].q1 - pcs[0].q0 != b:
            return None
        k0, k1 = pcs[0].runs[0]
        if k0 % b or (k1 - k0) % b:
            return None  # a short last key block
        rel = tuple((off, a - k0, c - k0) for off, a, c in pcs[0].masked)
        return (k0 // b - i, (k1 - k0) // b, rel)

    i = 0
    while i < len(rows):
        kk = key(i)
        j = i + 1
        # A call's biggest buffer: n blocks of output in the forward, n windows of w*b keys
        # in the backward (its dk and dv).
        width = b if fwd_only or kk is None else kk[1] * b
        max_n = max(2, _PIECE_BUDGET // (row_elems * width))
        while kk is not None and j < len(rows) and j - i < max_n and key(j) == kk:
            j += 1
        if kk is not None and j - i >= 2:
            groups.append(BandGroup(i, j - i, kk[0], kk[1], b))
            for r in range(i, j):
                rows[r] = []
        i = j
    return groups


class _AllTrue:
    """The mask of an unmasked problem: every tile full (so never evaluated)."""

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.ones((), dtype=torch.bool).expand(q_idx.shape[-2], kv_idx.shape[-1])

    def _block_states(self, g: Any) -> Tensor:
        return torch.full((1, 1, g.nq, g.nk), 2, dtype=torch.int8)

    __name__ = "no mask"


_all_true = _AllTrue()

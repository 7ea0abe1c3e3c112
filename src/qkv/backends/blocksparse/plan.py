"""Planning one block-sparse call: which pieces, band groups or mask-free segments compute
it, with which kernel family, within a bounded memory budget.

Most query blocks are one piece; a query block whose visible keys would need more than
``_PIECE_BUDGET`` scores at once (long rows with a score_mod, or a mask over very many keys)
is split into several pieces whose results are merged by their log-sum-exp (the online
softmax of FlashAttention). Plans are cached on block masks, and band masks' plans by value.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import torch

from ..._validate import Problem
from ...blockmask import DEFAULT_BLOCK, BlockMask, block_mask, for_problem
from ...masks import _And, _Band, _Document, _KvBelow, _Or
from .job import BandGroup, Job, KeyBandGroup, Piece, Schedule, Segment, fused_ok

Tensor = torch.Tensor

# Scores (or float-mask entries) one piece may hold at once: 4 Mi elements = 16 MiB in
# float32. Bounds the engine's extra memory whatever the sequence length (DESIGN.md: no path
# silently needs O(n²) memory).
_PIECE_BUDGET = 1 << 22


def _causal_like(mask: Any) -> bool:
    return isinstance(mask, _Band) and mask.lo is None and mask.hi == 0


def _pieces(bm: BlockMask, max_span: int, skip: frozenset[int] = frozenset()) -> list[list[Piece]]:
    """Split each query block's visible key blocks (but those in ``skip``) into pieces of at
    most ``max_span`` keys (at least one block each)."""
    Lk = bm.shape[3]
    bk = bm.block_size[1]
    out: list[list[Piece]] = []
    for i, row in enumerate(bm.rows()):
        pieces: list[Piece] = []
        chunk: list[tuple[int, bool]] = []
        width = 0
        for j, part in zip(row.blocks, row.partial, strict=True):
            if j in skip:
                continue
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
    if fused and bias is None and native_band(p, mask_src) is None:  # (fused: no score_mod)
        assert isinstance(mask_src, _Band)
        # The compiled band kernel computes the whole forward; the backward keeps the plan
        # it would have had (built on first use, so inference never plans it).
        job = Job(p, True, [], Schedule([], []), mask_src, None, None, seed, (1, 1))
        job.native_band = (int(mask_src.lo), int(mask_src.hi))  # type: ignore[arg-type]
        job.bwd_build = lambda: _torch_job(p, block_size, fused, bias, None, seed).bwd
        return job
    return _torch_job(p, block_size, fused, bias, score_mod, seed)


# Widest band (hi - lo) the compiled kernel takes: its per-thread buffers grow with it
# (32 x 8 K scores, a D x 8 K panel); wider bands are block-sparse enough for the pieces.
_NATIVE_MAX_WIDTH = 8192


def native_band(p: Problem, mask: Any, *, build: bool = True) -> str | None:
    """Why the compiled band kernel (``csrc/band_forward.cpp``) cannot compute this
    problem's forward, or ``None`` if it will. ``build=False`` answers without building it
    (for :func:`qkv.plan`, which must not wait ~30 s on a compiler)."""
    from . import native

    why_not_fused = fused_ok(p)
    if why_not_fused is not None:
        return why_not_fused
    if isinstance(p.score_mod, Tensor):
        return "a bias is added"
    if not isinstance(mask, _Band) or mask.lo is None or mask.hi is None:
        return "the mask is not a band with both edges (a sliding window)"
    if mask.hi - mask.lo > _NATIVE_MAX_WIDTH:
        return f"the band is wider than {_NATIVE_MAX_WIDTH} keys"
    if p.dtype != torch.float32:
        return f"it computes float32 only (inputs are {str(p.dtype).replace('torch.', '')})"
    if p.device.type not in ("cpu", "meta"):
        return f"it is a CPU kernel (tensors are on {p.device.type})"
    if p.Lq == 0 or p.Lk == 0:
        return "there are no queries or no keys"
    if not build or p.device.type == "meta":
        return native.disabled()
    if native.band_forward_op() is None:
        return native.disabled() or "the compiled kernel could not be loaded"
    return None


def _torch_job(
    p: Problem,
    block_size: int | tuple[int, int] | None,
    fused: bool,
    bias: Tensor | None,
    score_mod: Any,
    seed: int,
) -> Job:
    """The plan with torch's kernels (fused CPU flash per piece or band group, or explicit
    matmuls)."""
    mask = p.mask
    mask_src = mask.mask if isinstance(mask, BlockMask) else mask
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
        fwd = _band_schedule(mask_src, p, b_fwd)
        job = Job(p, True, [], fwd, mask_src, None, None, seed, (1, 1))
        job.bwd_build = functools.partial(_band_bwd_schedule, mask_src, p, _BWD_BAND_BLOCK)
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
    job = Job(p, fused, [], sched, mask_src, bias, score_mod, seed, md)
    if grouped:
        job.bwd_build = functools.partial(_key_schedule, bm, max_span, bq, _row_elems(p))
    return job


def _schedule(bm: BlockMask, max_span: int, group_b: int, row_elems: int) -> Schedule:
    """Pieces (and band groups of ``group_b`` blocks, if not 0) of a block mask, cached on
    it: a block mask reused across calls and layers is scheduled once."""
    cache = bm.__dict__.setdefault("_qkv_schedules", {})
    key = (max_span, group_b, row_elems)
    if key not in cache:
        rows = _pieces(bm, max_span)
        groups = _band_groups(rows, group_b, row_elems) if group_b else []
        cache[key] = Schedule(_merge_ends(rows) if group_b else rows, groups)
    return cache[key]


def _band_schedule(mask: _Band, p: Problem, b: int) -> Schedule:
    bm = _band_block_mask(mask.lo, mask.hi, p.Lq, p.Lk, b)
    max_span = max(1, _PIECE_BUDGET // b)
    return _schedule(bm, max_span, b, _row_elems(p))


def _band_bwd_schedule(mask: _Band, p: Problem, b: int) -> Schedule:
    bm = _band_block_mask(mask.lo, mask.hi, p.Lq, p.Lk, b)
    return _key_schedule(bm, max(1, _PIECE_BUDGET // b), b, _row_elems(p))


def _key_schedule(bm: BlockMask, max_span: int, b: int, row_elems: int) -> Schedule:
    """The backward's schedule of a band block mask with square ``b`` tiles: key-major groups
    (see :class:`KeyBandGroup`) where the band's columns repeat, pieces for the tiles of the
    other key blocks (the band's ends). Cached on the block mask."""
    cache = bm.__dict__.setdefault("_qkv_schedules", {})
    key = ("keys", max_span, b, row_elems)
    if key not in cache:
        groups = _key_groups(bm, b, row_elems)
        covered = frozenset(j for g in groups for j in range(g.j0, g.j0 + g.n))
        cache[key] = Schedule(_merge_ends(_pieces(bm, max_span, covered)), [], groups)
    return cache[key]


def _merge_ends(rows: list[list[Piece]]) -> list[list[Piece]]:
    """A band's ends, one fused call each: consecutive query blocks that are one piece over
    one key range each are merged into one piece over the union of their keys (the mask then
    evaluated on all of it) while that at most doubles the work. The ends of a 256-wide
    window are 8 blocks of 32 rows forward, 2 of 128 backward; one call per block cost
    ~0.2-0.4 ms each in kernel and Python overhead, several times their arithmetic."""
    out = [list(r) for r in rows]

    def single(i: int) -> bool:
        return len(out[i]) == 1 and len(out[i][0].runs) == 1

    i = 0
    while i < len(out):
        if not single(i):
            i += 1
            continue
        first = out[i][0]
        (k0, k1), area, q1 = first.runs[0], (first.q1 - first.q0) * first.span, first.q1
        j = i + 1
        while j < len(out) and single(j) and out[j][0].q0 == q1:
            a0, a1 = out[j][0].runs[0]
            if a0 > k1 or a1 < k0:
                break  # the union would not be one range
            n0, n1 = min(k0, a0), max(k1, a1)
            more = area + (out[j][0].q1 - q1) * out[j][0].span
            merged = (out[j][0].q1 - first.q0) * (n1 - n0)
            if merged > 2 * more or merged > _PIECE_BUDGET:
                break
            k0, k1, area, q1 = n0, n1, more, out[j][0].q1
            j += 1
        if j - i >= 2:
            out[i] = [Piece(first.q0, q1, [(k0, k1)], [(0, k0, k1)], seed=first.seed)]
            for r in range(i + 1, j):
                out[r] = []
        i = j
    return out


# Elements of a key-major group's largest kernel output (its overlapping dq windows): small
# enough that the kernel's zero-filled gradient buffers are reused from the heap rather than
# freshly page-faulted at every call, and stay in cache while they are folded back. Measured
# (fwd+bwd, window 256, n=4096, medians of 9): 4 Mi elements 80 ms, 2 Mi 69, 1 Mi 70,
# 512 Ki 69, 256 Ki 71.
_BWD_GROUP_BUDGET = 1 << 20


def _key_groups(bm: BlockMask, b: int, row_elems: int) -> list[KeyBandGroup]:
    """Runs of consecutive full-size key blocks whose visible query blocks are the same
    contiguous, full-size run shifted by one block each, with the same partial pattern."""
    Lk = bm.shape[3]
    rows = bm.rows()
    cols: list[list[tuple[int, bool]]] = [[] for _ in range(-(-Lk // b))]
    for i, row in enumerate(rows):
        for j, part in zip(row.blocks, row.partial, strict=True):
            cols[j].append((i, part))

    def key(j: int) -> tuple[Any, ...] | None:
        col = cols[j]
        if not col or (j + 1) * b > Lk:
            return None
        first = col[0][0]
        if any(i != first + t or rows[i].q1 - rows[i].q0 != b for t, (i, _) in enumerate(col)):
            return None
        return (first - j, len(col), tuple(part for _, part in col))

    groups: list[KeyBandGroup] = []
    j = 0
    while j < len(cols):
        kk = key(j)
        e = j + 1
        while kk is not None and e < len(cols) and key(e) == kk:
            e += 1
        if kk is not None and e - j >= 2:
            max_n = max(1, _BWD_GROUP_BUDGET // (row_elems * kk[1] * b))
            for s in range(j, e, max_n):
                groups.append(KeyBandGroup(s, min(max_n, e - s), kk[0], kk[1], b))
        j = e
    return groups


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
_BWD_BAND_BLOCK = DEFAULT_BLOCK


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


def _band_groups(rows: list[list[Piece]], b: int, row_elems: int) -> list[BandGroup]:
    """Batch consecutive query blocks whose pieces are the same band pattern shifted by one
    block each; their entries in ``rows`` are emptied (the group computes them). Forward
    only: the backward batches band rows key-major (:func:`_key_groups`)."""
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
        max_n = max(2, _PIECE_BUDGET // (row_elems * b))  # a call's output: n blocks of b rows
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

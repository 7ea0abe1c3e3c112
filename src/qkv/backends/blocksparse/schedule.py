"""The block-sparse engine's schedules: a block mask cut into pieces, band groups and
key-major groups, within a bounded memory budget.

Most query blocks are one piece; a query block whose visible keys would need more than
``PIECE_BUDGET`` scores at once (long rows with a score_mod, or a mask over very many keys) is
split into several pieces whose results are merged by their log-sum-exp (the online softmax
of FlashAttention). Schedules are cached on their block mask, and band masks' block masks by
value, so a model calling the same mask in every layer schedules it once.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._core.kinds import band
from ..._core.lru import LRU
from ..._core.problem import Problem
from ..._core.tiles import DEFAULT_BLOCK
from ...blockmask import BlockMask, build
from .job import BandGroup, KeyBandGroup, Piece, Schedule

Tensor = torch.Tensor


# Scores (or float-mask entries) one piece may hold at once: 4 Mi elements = 16 MiB in
# float32. Bounds the engine's extra memory whatever the sequence length (the contract: no path
# silently needs O(n²) memory).
PIECE_BUDGET = 1 << 22


def pieces(bm: BlockMask, max_span: int, skip: frozenset[int] = frozenset()) -> list[list[Piece]]:
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


def schedule(bm: BlockMask, max_span: int, group_b: int, row_elems: int) -> Schedule:
    """Pieces (and band groups of ``group_b`` blocks, if not 0) of a block mask, cached on
    it: a block mask reused across calls and layers is scheduled once."""
    key = (max_span, group_b, row_elems)
    got: Schedule | None = bm.schedules.get(key)
    if got is None:
        rows = pieces(bm, max_span)
        groups = _band_groups(rows, group_b, row_elems) if group_b else []
        got = Schedule(_merge_ends(rows) if group_b else rows, groups)
        bm.schedules.put(key, got)
    return got


def band_schedule(lo: int | None, hi: int | None, p: Problem, b: int) -> Schedule:
    bm = _band_block_mask(lo, hi, p.Lq, p.Lk, b)
    max_span = max(1, PIECE_BUDGET // b)
    return schedule(bm, max_span, b, row_elems(p))


def band_bwd_schedule(
    lo: int | None, hi: int | None, Lq: int, Lk: int, elems: int, b: int
) -> Schedule:
    bm = _band_block_mask(lo, hi, Lq, Lk, b)
    return key_schedule(bm, max(1, PIECE_BUDGET // b), b, elems)


def key_schedule(bm: BlockMask, max_span: int, b: int, row_elems: int) -> Schedule:
    """The backward's schedule of a band block mask with square ``b`` tiles: key-major groups
    (see :class:`KeyBandGroup`) where the band's columns repeat, pieces for the tiles of the
    other key blocks (the band's ends). Cached on the block mask."""
    key = ("keys", max_span, b, row_elems)
    got: Schedule | None = bm.schedules.get(key)
    if got is None:
        groups = _key_groups(bm, b, row_elems)
        covered = frozenset(j for g in groups for j in range(g.j0, g.j0 + g.n))
        got = Schedule(_merge_ends(pieces(bm, max_span, covered)), [], groups)
        bm.schedules.put(key, got)
    return got


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
            if merged > 2 * more or merged > PIECE_BUDGET:
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
_BAND_CACHE: LRU[tuple[Any, ...], BlockMask] = LRU(8)
_BAND_CACHE_CELLS = 1 << 22


def _band_block_mask(lo: int | None, hi: int | None, Lq: int, Lk: int, b: int) -> BlockMask:
    key = (lo, hi, Lq, Lk, b)
    bm = _BAND_CACHE.get(key)
    if bm is not None:
        return bm
    bm = build(band(lo, hi), (1, 1, Lq, Lk), (True, True), (b, b), torch.device("cpu"))
    if bm.states.numel() <= _BAND_CACHE_CELLS:
        _BAND_CACHE.put(key, bm)
    return bm


FWD_BAND_BLOCK = 32
BWD_BAND_BLOCK = DEFAULT_BLOCK


def row_elems(p: Problem) -> int:
    """Elements per (query or key) position across batch and heads, at the fused kernel's
    padded head dim: band-group calls are sized by it so that a call's largest output (the
    overlapping key-window gradients, in the backward) stays within ``PIECE_BUDGET``."""
    return p.B * p.Hq * max(p.D, p.Dv, 1)


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
        max_n = max(2, PIECE_BUDGET // (row_elems * b))  # a call's output: n blocks of b rows
        while kk is not None and j < len(rows) and j - i < max_n and key(j) == kk:
            j += 1
        if kk is not None and j - i >= 2:
            groups.append(BandGroup(i, j - i, kk[0], kk[1], b))
            for r in range(i, j):
                rows[r] = []
        i = j
    return groups

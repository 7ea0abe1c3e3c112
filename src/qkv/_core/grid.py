"""The tiling of a score matrix and the tile rules built-in masks are written with.

A :class:`Grid` cuts a ``[B, H, Lq, Lk]`` score matrix into ``bq x bk`` blocks; a tile is
empty (0), partial (1) or full (2). The rules here (:func:`band_states`,
:func:`below_states`, :func:`document_states`) classify every block from its bounds alone,
in O(number of tiles) work; each built-in mask's class (:mod:`qkv._core.builtin_mods`) gives
its own rule with them, and :mod:`qkv._core.tiles` asks the mask for it.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

EMPTY, PARTIAL, FULL = 0, 1, 2

DEFAULT_BLOCK = 128
# Positions evaluated per mask_mod call when a mask has no analytic rule: bounds the memory a
# mask_mod's temporaries can take (an int64 intermediate of this many elements is 32 MiB).
EVAL_BUDGET = 1 << 22


class Grid:
    """The tiling of a ``[B, H, Lq, Lk]`` score matrix into ``bq x bk`` blocks: the block
    bounds a tile rule reads (:meth:`from_ranges` turns per-row ranges of blocks into states),
    and the names of mask_mods that had to be evaluated (``qkv._core.tiles.classify``)."""

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


def band_states(lo_: int | None, hi_: int | None, g: Grid) -> Tensor:
    """``lo <= kv_idx - q_idx <= hi`` (``None`` = unbounded)."""
    # Rows r of a query block see keys [r + lo, r + hi]; the union over the block's rows
    # [qs, ql] is [qs + lo, ql + hi], and a key block [ks, kl] is full iff every row sees
    # all of it: ks >= ql + lo and kl <= qs + hi. O(nq) arithmetic, then one grid fill.
    big = g.Lq + g.Lk + 1  # an unbounded side reaches past every index
    lo = -big if lo_ is None else lo_
    hi = big if hi_ is None else hi_
    qs, ql = g.q_start, g.q_last  # [nq] first and last row of each query block
    first_key = (qs + lo).clamp(min=0)
    last_key = (ql + hi).clamp(max=g.Lk - 1)
    vis_lo, vis_hi = first_key // g.bk, last_key // g.bk
    vis_hi = torch.where(first_key > last_key, vis_lo - 1, vis_hi)  # no key at all
    # Full blocks: k_start[j] >= ql + lo and k_last[j] <= qs + hi.
    full_lo = torch.searchsorted(g.k_start, ql + lo)  # first j with k_start[j] >= ql + lo
    full_hi = torch.searchsorted(g.k_last, qs + hi, right=True) - 1
    return g.from_ranges(vis_lo, vis_hi, full_lo, full_hi)


def below_states(limit: int | Tensor, g: Grid, start: Tensor | None = None) -> Tensor:
    """``start <= kv_idx < limit`` (an int, or one limit per batch element; ``start`` None
    or one per batch element)."""
    # Key block j is visible iff it reaches past the start and its first key is below the
    # limit; full iff it lies inside [start, limit).
    if isinstance(limit, int):
        lim = torch.tensor([limit], dtype=torch.int64)  # [1]
    else:
        lim = limit.detach().to("cpu", torch.int64)  # [B]
    lim = lim.view(-1, 1, 1)  # [B, 1, 1]: one key range per batch element, for every row
    vis_hi = (lim.clamp(max=g.Lk) + g.bk - 1) // g.bk - 1  # last j with k_start[j] < lim
    full_hi = torch.searchsorted(g.k_last, lim.view(-1) - 1, right=True).view(-1, 1, 1) - 1
    if start is None:
        zero = torch.zeros_like(vis_hi)
        return g.from_ranges(zero, vis_hi, zero, full_hi)  # [B, 1, 1, nk]
    st = start.detach().to("cpu", torch.int64).view(-1)  # [B]
    vis_lo = torch.searchsorted(g.k_last, st).view(-1, 1, 1)  # first j with k_last[j] >= st
    vis_hi = torch.where(st.view(-1, 1, 1) >= lim, vis_lo - 1, vis_hi)  # an empty range
    full_lo = torch.searchsorted(g.k_start, st).view(-1, 1, 1)  # first j with k_start >= st
    return g.from_ranges(vis_lo, vis_hi, full_lo, full_hi)  # [B, 1, 1, nk]


def document_states(all_ids: Tensor, g: Grid) -> Tensor:
    """``ids[b, q_idx] == ids[b, kv_idx]`` for ids ``[R, L]`` (``R`` 1, shared by every batch
    element, or one row per batch element): states ``[R, 1, nq, nk]``."""
    ids = all_ids.detach().to("cpu")[:, : max(g.Lq, g.Lk)]  # [R, n]
    if ids.shape[1] > 1 and not bool((ids[:, 1:] >= ids[:, :-1]).all()):
        return _document_unsorted(ids, g)
    # Sorted ids (packed sequences): each block holds the ids [ids[first], ids[last]], and
    # two blocks share a document iff those ranges overlap. Because ids are sorted, the
    # visible key blocks of a query block are one contiguous run, found by binary search
    # (batched: one sorted sequence per row of ids).
    R = ids.shape[0]
    qmin, qmax = ids[:, g.q_start], ids[:, g.q_last]  # [R, nq]
    kmin, kmax = ids[:, g.k_start].contiguous(), ids[:, g.k_last].contiguous()  # [R, nk]
    vis_lo = torch.searchsorted(kmax, qmin)  # first j with kmax[j] >= qmin
    vis_hi = torch.searchsorted(kmin, qmax, right=True) - 1  # last j with kmin[j] <= qmax
    # Full: both blocks lie inside one document, the same one.
    single = qmin == qmax
    full_lo = torch.searchsorted(kmin, qmin)  # first j with kmin[j] >= qmin
    full_hi = torch.searchsorted(kmax, qmin, right=True) - 1  # last j with kmax[j] <= qmin
    full_hi = torch.where(single, full_hi, full_lo - 1)
    states = g.from_ranges(vis_lo, vis_hi, full_lo, full_hi)  # [1, R, nq, nk]
    return states.view(R, 1, g.nq, g.nk)


# Above this many (query block x key block x document) cells, unsorted document ids are planned
# conservatively (every block partial) instead of exactly.
_PRESENCE_CELLS = 1 << 26


def _document_unsorted(ids: Tensor, g: Grid) -> Tensor:
    """Block states for unsorted document ids ``[R, n]``: which documents each block contains
    (a presence matrix per row of ids), then a block pair is visible iff they share one. Exact
    at block level while ``R * nq * nk * documents`` stays small; otherwise every block is
    (conservatively) partial, which is correct but skips nothing."""
    R = ids.shape[0]
    _, code = torch.unique(ids, return_inverse=True)  # [R, n] document index 0..n_docs-1
    n_docs = int(code.max()) + 1
    if R * g.nq * g.nk * n_docs > _PRESENCE_CELLS:
        return torch.ones(R, 1, g.nq, g.nk, dtype=torch.int8)  # every block partial

    def presence(n_blocks: int, length: int, size: int) -> Tensor:
        pres = torch.zeros(R, n_blocks, n_docs)  # [R, n_blocks, n_docs]
        row = torch.arange(R).view(R, 1)  # [R, 1]
        pos = torch.arange(length).view(1, length)  # [1, length]
        pres[row, pos // size, code[:, :length]] = 1.0
        return pres

    pq, pk = presence(g.nq, g.Lq, g.bq), presence(g.nk, g.Lk, g.bk)
    vis = (pq @ pk.mT) > 0  # [R, nq, nk]: the blocks share at least one document
    one_q = (pq.sum(-1) == 1).unsqueeze(-1)  # [R, nq, 1]: the query block holds one document
    one_k = (pk.sum(-1) == 1).unsqueeze(-2)  # [R, 1, nk]
    same = (pq.argmax(-1).unsqueeze(-1) == pk.argmax(-1).unsqueeze(-2)) & one_q & one_k
    return (vis.to(torch.int8) + (vis & same).to(torch.int8)).view(R, 1, g.nq, g.nk)

"""The plan of a context-parallel call: which key/value rows travel where, in which step, and
what each rank computes. ``qd.plan`` prints it; ``qd.attention`` executes the same one.

From qkv's block classification of the mask at global positions, with one tile per chunk
(:class:`qkv._core.grid.Grid` with ``bq = bk = c``, analytic for every built-in mask), each
(query chunk, key chunk) pair is empty, partial or full; a partial pair is classified again
at ``c / 16`` resolution (at most 128 positions) to find the key rows its queries see. Rank
``s`` sends rank ``r`` only those rows of its chunks (their hull, one piece per chunk), and
only if some query chunk of ``r`` sees some of them; the sends follow a ring (step ``t``:
rank ``r`` receives from ``r - t`` and sends to ``r + t``), so every step is a permutation.
A sliding window therefore moves the window's rows between neighbours only, causal sends
nothing backwards in the contiguous layout, and documents only reach the ranks that share
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core.kinds import MaskKind
from .._core.tiles import EMPTY, FULL, PARTIAL, Grid, classify
from .._door import mask_kind
from .layout import Layout
from .positions import mask_for

Tensor = torch.Tensor

# The coarsest tile inside a partial chunk pair (key ranges, FLOP estimate): qkv's default.
_FLOP_TILE = 128


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of chunk ``chunk`` (offsets inside the chunk): what a message
    carries of it, the hull of the key rows the receiver's queries see there."""

    chunk: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Pair:
    """A query chunk of this rank against a piece of a key chunk: ``state`` (of the chunk
    pair) is partial or full."""

    q_chunk: int
    keys: Piece
    state: int


@dataclass(frozen=True)
class Step:
    """Step ``index`` of one rank: receive ``recv`` from ``recv_from`` (this step's source),
    send ``send`` to ``send_to``, then compute ``pairs`` with what arrived (step 0: the rank's
    own chunks, nothing moves)."""

    index: int
    recv_from: int
    recv: tuple[Piece, ...]
    send_to: int
    send: tuple[Piece, ...]
    pairs: tuple[Pair, ...]
    flops: float = 0.0  # forward FLOPs of this step's pairs

    @property
    def recv_chunks(self) -> tuple[int, ...]:
        return tuple(p.chunk for p in self.recv)

    @property
    def send_chunks(self) -> tuple[int, ...]:
        return tuple(p.chunk for p in self.send)


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a :class:`Plan`: its ``rows``, its ``steps`` in order, the bytes it
    sends and receives forward and backward, and its forward ``flops``."""

    rank: int
    rows: int
    steps: tuple[Step, ...]
    bytes_sent: int  # forward: K/V chunks sent (the backward sends as much again, and dK/dV)
    bytes_received: int
    backward_bytes_sent: int  # K/V chunks again, plus dK/dV partial sums back to their owners
    backward_bytes_received: int
    flops: float  # forward matmul FLOPs, 2 * B * Hq * (D + Dv) per visible tile position

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks this one exchanges anything with."""
        s = {st.recv_from for st in self.steps[1:] if st.recv_chunks}
        s |= {st.send_to for st in self.steps[1:] if st.send_chunks}
        return tuple(sorted(s))


@dataclass(frozen=True)
class Plan:
    """``ranks[r]`` of a context-parallel attention call; ``str()`` for a person."""

    layout: Layout
    B: int
    Hq: int
    Hkv: int
    D: int
    Dv: int
    element_size: int
    mask: str
    states: Tensor  # int8 [n_chunks, n_chunks]: empty / partial / full per chunk pair
    ranks: tuple[RankPlan, ...]

    @property
    def imbalance(self) -> float:
        """The busiest rank's FLOPs over the idlest's (1.0 = perfectly balanced)."""
        f = [r.flops for r in self.ranks]
        lo, hi = min(f), max(f)
        if hi == 0:
            return 1.0
        return float("inf") if lo == 0 else hi / lo

    @property
    def allgather_bytes(self) -> int:
        """Bytes one rank receives when every rank all-gathers K/V (torch's default CP)."""
        per_row = self.B * self.Hkv * (self.D + self.Dv) * self.element_size
        return (self.layout.L - min(self.layout.lengths)) * per_row

    def __str__(self) -> str:
        lay = self.layout
        lines = [
            f"qkv.distributed plan: {lay.kind} layout, world size {lay.world_size}, "
            f"L = {lay.L} (chunks of {lay.chunk}), B={self.B} Hq={self.Hq} Hkv={self.Hkv} "
            f"D={self.D} Dv={self.Dv}",
            f"mask: {self.mask}",
            f"imbalance (busiest / idlest rank's FLOPs): {self.imbalance:.2f}",
        ]
        for rp in self.ranks:
            moves = [
                f"{st.index}: from {st.recv_from} {_pieces(lay, st.recv)}, "
                f"to {st.send_to} {_pieces(lay, st.send)}"
                for st in rp.steps[1:]
                if st.recv_chunks or st.send_chunks
            ]
            lines.append(
                f"rank {rp.rank}: {rp.rows} rows, {rp.flops / 1e9:.3g} GFLOP, "
                f"sent {_fmt(rp.bytes_sent)}, received {_fmt(rp.bytes_received)} "
                f"(backward {_fmt(rp.backward_bytes_sent)} / "
                f"{_fmt(rp.backward_bytes_received)}), peers {list(rp.peers)}"
            )
            lines.append("  steps " + ("; ".join(moves) if moves else "none: nothing moves"))
        lines.append(f"an all-gather of K/V would receive {_fmt(self.allgather_bytes)} per rank")
        return "\n".join(lines)


def _pieces(lay: Layout, ps: tuple[Piece, ...]) -> str:
    """Global key ranges, ``[a, b)``."""
    if not ps:
        return "nothing"
    a = [lay.bounds(p.chunk)[0] for p in ps]
    return " ".join(f"[{x + p.lo}, {x + p.hi})" for x, p in zip(a, ps, strict=True))


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def chunk_states(m: MaskKind, lay: Layout, B: int, H: int, device: torch.device) -> Tensor:
    """int8 ``[n, n]``: a chunk pair is full only if every (b, h) sees all of it, empty only
    if none sees any of it."""
    n, c = lay.n_chunks, lay.chunk
    g = Grid(B, H, lay.L, lay.L, c, c, device)
    st = classify(g, m).to(torch.int8)  # [B|1, H|1, nq|1, nk|1], nq = ceil(L / c) <= n
    st = st.expand(st.shape[0], st.shape[1], g.nq, g.nk)  # a padding mask's rows broadcast
    vis = (st != EMPTY).flatten(0, 1).any(0)  # [nq, nk]
    full = (st == FULL).flatten(0, 1).all(0)
    out = torch.zeros(n, n, dtype=torch.int8)
    nq, nk = vis.shape
    out[:nq, :nk] = torch.where(full, FULL, torch.where(vis, PARTIAL, EMPTY)).to(torch.int8)
    return out


def _pair_detail(
    m: MaskKind, lay: Layout, qc: int, kc: int, state: int, B: int, H: int, device: torch.device
) -> tuple[int, int, int] | None:
    """``(lo, hi, area)`` of a chunk pair: the key rows ``[lo, hi)`` of chunk ``kc`` that
    some query of chunk ``qc`` sees, to the resolution of a fine tiling (``c / 16``
    positions, at most qkv's default block of 128), and the score positions of its visible
    tiles (the FLOP estimate). ``None`` when the pair is empty."""
    q, k = lay.bounds(qc), lay.bounds(kc)
    lq, lk = q[1] - q[0], k[1] - k[0]
    if state == EMPTY or lq == 0 or lk == 0:
        return None
    if state == FULL:
        return 0, lk, lq * lk
    f = max(1, min(_FLOP_TILE, lay.chunk // 16))
    sub = mask_kind(mask_for(m, q, k, lay.L))  # the shifted mask, classified as qkv would
    g = Grid(B, H, lq, lk, f, f, device)
    st = classify(g, sub).amax(dim=(0, 1)).expand(g.nq, g.nk)  # [nq, nk], any (b, h)
    vis = st != EMPTY
    cols_seen = vis.any(0).nonzero().view(-1)  # key tiles some query tile sees
    if cols_seen.numel() == 0:
        return None
    rows = (g.q_last - g.q_start + 1).view(-1, 1)  # [nq, 1]
    cols = (g.k_last - g.k_start + 1).view(1, -1)  # [1, nk]
    lo, hi = int(g.k_start[cols_seen[0]]), int(g.k_last[cols_seen[-1]]) + 1
    return lo, hi, int((vis * rows * cols).sum())


def build(
    m: MaskKind,
    lay: Layout,
    *,
    B: int,
    Hq: int,
    Hkv: int,
    D: int,
    Dv: int,
    element_size: int,
    grad_size: int,
    device: torch.device,
) -> Plan:
    """The plan of every rank (each rank builds all of them: the sends of one are the
    receives of another). ``grad_size``: bytes per element of the dK/dV partial sums (the
    compute dtype)."""
    W = lay.world_size
    states = chunk_states(m, lay, B, Hq, device)
    row_kv = B * Hkv * (D + Dv)
    detail: dict[tuple[int, int], tuple[int, int, int] | None] = {}

    def pair(i: int, j: int) -> tuple[int, int, int] | None:
        if (i, j) not in detail:
            detail[(i, j)] = _pair_detail(m, lay, i, j, int(states[i, j]), B, Hq, device)
        return detail[(i, j)]

    def needed(r: int, s: int) -> tuple[Piece, ...]:
        """The pieces of rank s's chunks that some query chunk of rank r sees."""
        out = []
        for j in lay.chunks(s):
            seen = [d for d in (pair(i, j) for i in lay.chunks(r)) if d is not None]
            if seen:
                out.append(Piece(j, min(d[0] for d in seen), max(d[1] for d in seen)))
        return tuple(out)

    def rows(pieces: tuple[Piece, ...]) -> int:
        return sum(p.rows for p in pieces)

    ranks = []
    for r in range(W):
        steps, sent, recv = [], 0, 0
        total = 0.0
        for t in range(W):
            src, dst = (r - t) % W, (r + t) % W
            own = tuple(Piece(j, 0, lay.chunk_len(j)) for j in lay.chunks(r))
            got = needed(r, src) if t else own
            give = needed(dst, r) if t else ()
            pairs = tuple(
                Pair(i, pc, int(states[i, pc.chunk]))
                for i in lay.chunks(r)
                for pc in got
                if pair(i, pc.chunk) is not None
            )
            step_flops = 0.0
            for p in pairs:
                d = pair(p.q_chunk, p.keys.chunk)
                assert d is not None
                step_flops += 2.0 * B * Hq * (D + Dv) * d[2]
            steps.append(Step(t, src, got if t else (), dst, give, pairs, step_flops))
            total += step_flops
            if t:
                sent += rows(give) * row_kv
                recv += rows(got) * row_kv
        ranks.append(
            RankPlan(
                rank=r,
                rows=lay.length(r),
                steps=tuple(steps),
                bytes_sent=sent * element_size,
                bytes_received=recv * element_size,
                backward_bytes_sent=sent * element_size + recv * grad_size,
                backward_bytes_received=recv * element_size + sent * grad_size,
                flops=total,
            )
        )
    return Plan(lay, B, Hq, Hkv, D, Dv, element_size, m.name, states, tuple(ranks))

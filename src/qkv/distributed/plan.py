"""The plan of a context-parallel call: which key/value chunks travel where, in which step,
and what each rank computes. ``qd.plan`` prints it; ``qd.attention`` executes the same one.

From qkv's block classification of the mask at global positions, with one tile per chunk
(:class:`qkv._tiles.Grid` with ``bq = bk = c``, analytic for every built-in mask), each
(query chunk, key chunk) pair is empty, partial or full. Rank ``s`` sends its chunk ``j`` to
rank ``r`` only if some query chunk of ``r`` sees some of ``j``; the sends follow a ring
(step ``t``: rank ``r`` receives from ``r - t`` and sends to ``r + t``), so every step is a
permutation and ``isend``/``irecv`` of one step never wait on each other. A sliding window
narrower than a chunk therefore talks only to neighbours, a causal mask sends nothing
backwards in the contiguous layout, and documents only reach the ranks that share them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._kinds import MaskKind
from .._problem import mask_kind
from .._tiles import EMPTY, FULL, PARTIAL, Grid
from .layout import Layout
from .positions import mask_for

Tensor = torch.Tensor

# The tile of the FLOP estimate inside a partial chunk pair: qkv's default block.
_FLOP_TILE = 128


@dataclass(frozen=True)
class Pair:
    """A query chunk of this rank against a key chunk: ``state`` is partial or full."""

    q_chunk: int
    k_chunk: int
    state: int


@dataclass(frozen=True)
class Step:
    """Step ``index`` of one rank: receive ``recv_chunks`` from ``recv_from`` (this step's
    source), send ``send_chunks`` to ``send_to``, then compute ``pairs`` with the received
    chunks (step 0: the rank's own chunks, nothing moves)."""

    index: int
    recv_from: int
    recv_chunks: tuple[int, ...]
    send_to: int
    send_chunks: tuple[int, ...]
    pairs: tuple[Pair, ...]


@dataclass(frozen=True)
class RankPlan:
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
                f"{st.index}: from {st.recv_from} chunks {list(st.recv_chunks)}, "
                f"to {st.send_to} chunks {list(st.send_chunks)}"
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
    st = g.classify(m).to(torch.int8)  # [B|1, H|1, nq|1, nk|1], nq = ceil(L / c) <= n
    st = st.expand(st.shape[0], st.shape[1], g.nq, g.nk)  # a padding mask's rows broadcast
    vis = (st != EMPTY).flatten(0, 1).any(0)  # [nq, nk]
    full = (st == FULL).flatten(0, 1).all(0)
    out = torch.zeros(n, n, dtype=torch.int8)
    nq, nk = vis.shape
    out[:nq, :nk] = torch.where(full, FULL, torch.where(vis, PARTIAL, EMPTY)).to(torch.int8)
    return out


def _pair_area(m: MaskKind, lay: Layout, qc: int, kc: int, state: int, B: int, H: int) -> int:
    """Score positions a partial call computes: its visible 128 x 128 tiles."""
    q, k = lay.bounds(qc), lay.bounds(kc)
    lq, lk = q[1] - q[0], k[1] - k[0]
    if state == FULL:
        return lq * lk
    sub = mask_kind(mask_for(m, q, k, lay.L))
    g = Grid(B, H, lq, lk, _FLOP_TILE, _FLOP_TILE, torch.device("cpu"))
    st = g.classify(sub).amax(dim=(0, 1)).expand(g.nq, g.nk)  # visible for some (b, h)
    rows = (g.q_last - g.q_start + 1).view(-1, 1)  # [nq, 1]
    cols = (g.k_last - g.k_start + 1).view(1, -1)  # [1, nk]
    return int(((st != EMPTY) * rows * cols).sum())


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
    flops: bool = True,
) -> Plan:
    """The plan of every rank (each rank builds all of them: the sends of one are the
    receives of another). ``flops=False`` skips the FLOP estimate (the run does not need it).
    ``grad_size``: bytes per element of the dK/dV partial sums (the compute dtype)."""
    W = lay.world_size
    states = chunk_states(m, lay, B, Hq, device)
    row_kv = B * Hkv * (D + Dv)

    def needed(r: int, s: int) -> tuple[int, ...]:
        """Rank s's chunks that some query chunk of rank r sees (non-empty chunks only)."""
        return tuple(
            j
            for j in lay.chunks(s)
            if lay.chunk_len(j)
            and any(lay.chunk_len(i) and states[i, j] != EMPTY for i in lay.chunks(r))
        )

    def rows(chunks: tuple[int, ...]) -> int:
        return sum(lay.chunk_len(j) for j in chunks)

    ranks = []
    for r in range(W):
        steps, sent, recv = [], 0, 0
        total = 0.0
        for t in range(W):
            src, dst = (r - t) % W, (r + t) % W
            got = needed(r, src) if t else lay.chunks(r)
            give = needed(dst, r) if t else ()
            pairs = tuple(
                Pair(i, j, int(states[i, j]))
                for i in lay.chunks(r)
                for j in got
                if lay.chunk_len(i) and lay.chunk_len(j) and states[i, j] != EMPTY
            )
            steps.append(Step(t, src, got if t else (), dst, give, pairs))
            if t:
                sent += rows(give) * row_kv
                recv += rows(got) * row_kv
            if flops:
                area = sum(_pair_area(m, lay, p.q_chunk, p.k_chunk, p.state, B, Hq) for p in pairs)
                total += 2.0 * B * Hq * (D + Dv) * area
        rows_kv_sent, rows_kv_recv = sent // max(1, row_kv), recv // max(1, row_kv)
        ranks.append(
            RankPlan(
                rank=r,
                rows=lay.length(r),
                steps=tuple(steps),
                bytes_sent=sent * element_size,
                bytes_received=recv * element_size,
                backward_bytes_sent=(sent * element_size + rows_kv_recv * row_kv * grad_size),
                backward_bytes_received=(recv * element_size + rows_kv_sent * row_kv * grad_size),
                flops=total,
            )
        )
    return Plan(lay, B, Hq, Hkv, D, Dv, element_size, m.name, states, tuple(ranks))

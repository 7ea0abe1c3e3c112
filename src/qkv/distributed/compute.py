"""The work of one rank: partial attention per (query chunk, key chunk) pair, merged exactly
by log-sum-exp, with the key/value chunks of later steps arriving while earlier ones compute.

Forward: for query rows ``Q`` and disjoint key sets ``K_i``, attention over their union is

    lse = logsumexp_i(lse_i)        out = sum_i exp(lse_i - lse) * out_i

(a row no key reaches keeps ``lse = -inf`` and ``out = 0``). Backward: with the final
``out``, ``lse`` and the upstream ``dout``, ``dlse``, the gradient of pair ``i`` is the
gradient of its partial call under ``dout_i = w_i dout`` and
``dlse_i = w_i (dout . out_i - dout . out + dlse)`` with ``w_i = exp(lse_i - lse)``, which is
``dS = P (dP - rowsum(dout . out) + dlse)`` with ``P`` the global probabilities: the partial
is recomputed under autograd (one more partial forward per pair) and differentiated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .._core.kinds import MaskKind, ScoreKind
from .._core.tiles import FULL
from ..functional import attention
from .layout import Layout
from .plan import Pair, Piece, Plan, Step
from .positions import mask_for, score_for
from .transport import Exchange, Pending, note_time

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class Spec:
    """Everything a rank's forward and backward need, decided once per call."""

    group: Any
    rank: int
    layout: Layout
    plan: Plan
    mask: MaskKind
    score: ScoreKind
    scale: float
    n_params: int


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types are computed per pair in float32, so the merge loses nothing to rounding."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _partial(spec: Spec, pair: Pair, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    lay = spec.layout
    qb, ka = lay.bounds(pair.q_chunk), lay.bounds(pair.keys.chunk)[0]
    kb = (ka + pair.keys.lo, ka + pair.keys.hi)  # the global positions of the piece's keys
    mask = None if pair.state == FULL else mask_for(spec.mask, qb, kb, lay.L)
    smod = score_for(spec.score, qb, kb, lay.L)
    t0 = time.perf_counter()
    out, lse = attention(q, k, v, mask=mask, score_mod=smod, scale=spec.scale, return_lse=True)
    note_time(compute=time.perf_counter() - t0)
    return out, lse


class Chunks:
    """Key/value pieces by chunk id: this rank's own chunks, or what a step's message
    carries (its pieces side by side, in the step's order)."""

    def __init__(self, spec: Spec, k: Tensor, v: Tensor, step: Step, buf: Tensor | None) -> None:
        lay, D = spec.layout, k.shape[3]
        self.at: dict[int, tuple[int, Piece]] = {}
        if buf is None and step.recv:
            raise AssertionError(f"step {step.index} has no message for {step.recv}")
        if buf is None:  # step 0 (the local shards), or a step that receives nothing
            self.k, self.v = k, v
            for j in lay.chunks(spec.rank):
                self.at[j] = (lay.local_start(spec.rank, j), Piece(j, 0, lay.chunk_len(j)))
        else:
            self.k, self.v = buf[..., :D], buf[..., D:]
            off = 0
            for pc in step.recv:
                self.at[pc.chunk] = (off, pc)
                off += pc.rows

    def kv(self, j: int) -> tuple[Tensor, Tensor]:
        a, pc = self.at[j]
        return self.k.narrow(2, a, pc.rows), self.v.narrow(2, a, pc.rows)

    def offset(self, j: int) -> int:
        return self.at[j][0]


def pack(lay: Layout, rank: int, k: Tensor, v: Tensor, pieces: tuple[Piece, ...]) -> Tensor:
    """``[B, Hkv, rows, D + Dv]``: the keys and values of ``pieces``, side by side."""
    parts = []
    for pc in pieces:
        a = lay.local_start(rank, pc.chunk) + pc.lo
        parts.append(torch.cat((k.narrow(2, a, pc.rows), v.narrow(2, a, pc.rows)), dim=-1))
    return torch.cat(parts, dim=2)


def rows_of(pieces: tuple[Piece, ...]) -> int:
    return sum(pc.rows for pc in pieces)


def post_kv(spec: Spec, ex: Exchange, step: Step, k: Tensor, v: Tensor, tag: int) -> Pending | None:
    """Send this step's pieces to its destination and post the receive of its source's, as
    one batch; the receive's handle (None when nothing comes)."""
    lay = spec.layout
    sends = [(pack(lay, spec.rank, k, v, step.send), step.send_to, tag)] if step.send else []
    B, H, _, D = k.shape
    shape = (B, H, rows_of(step.recv), D + v.shape[3])
    recvs = [(shape, k.dtype, k.device, step.recv_from, tag)] if step.recv else []
    got = ex.post(sends, recvs)
    return got[0] if got else None


# Messages in flight ahead of the step being computed: step i + 1 and i + 2 arrive while step
# i computes (steps that move nothing are skipped), so a sparse schedule (a window in the
# zigzag layout: steps 1 and W - 1 only) still overlaps both of its messages with compute;
# at most DEPTH received buffers wait beside the one in use.
DEPTH = 2


def run_steps(spec: Spec, ex: Exchange, k: Tensor, v: Tensor, visit: Any) -> None:
    """Call ``visit(step, chunks)`` for step 0 and every step that moves something, posting
    the messages of the next ``DEPTH`` such steps before computing the current one. Deadlock
    free: a rank posts step t's send before it waits for any step >= t, so every wait of
    step t is met once all ranks passed their waits of earlier steps."""
    steps = spec.plan.ranks[spec.rank].steps
    active = [st for st in steps[1:] if st.recv or st.send]
    pending: dict[int, Pending | None] = {}

    def post(i: int) -> None:
        if i < len(active):
            pending[i] = post_kv(spec, ex, active[i], k, v, tag=active[i].index)

    for i in range(DEPTH):
        post(i)
    visit(steps[0], Chunks(spec, k, v, steps[0], None))
    for i, st in enumerate(active):
        post(i + DEPTH)
        got = pending.pop(i)
        # A step that receives nothing is still visited: it may expect dK/dV back.
        visit(st, Chunks(spec, k, v, st, got.wait() if got is not None else None))
    ex.finish()


def forward(spec: Spec, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's ``out [B, Hq, L_local, Dv]`` (work dtype) and ``lse [B, Hq, L_local]``."""
    lay, rank = spec.layout, spec.rank
    wd = work_dtype(q.dtype)
    B, Hq, Ll, _ = q.shape
    out = q.new_zeros(B, Hq, Ll, v.shape[3], dtype=wd)
    lse = torch.full((B, Hq, Ll), float("-inf"), dtype=wd, device=q.device)

    def visit(step: Step, ch: Chunks) -> None:
        for pair in step.pairs:
            a, n = lay.local_start(rank, pair.q_chunk), lay.chunk_len(pair.q_chunk)
            kj, vj = ch.kv(pair.keys.chunk)
            o_i, l_i = _partial(spec, pair, q.narrow(2, a, n).to(wd), kj.to(wd), vj.to(wd))
            o, ls = out.narrow(2, a, n), lse.narrow(2, a, n)
            new = torch.logaddexp(ls, l_i)
            safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
            wa = torch.exp(ls - safe).unsqueeze(-1).to(wd)  # [B, Hq, n, 1]
            wb = torch.exp(l_i - safe).unsqueeze(-1).to(wd)
            o.copy_(o * wa + o_i.to(wd) * wb)
            ls.copy_(new)

    run_steps(spec, Exchange(spec.group, "forward"), k, v, visit)
    return out, lse

"""The backward of one rank (see :mod:`qkv.distributed.compute` for the formula).

The key/value chunks travel again along the forward's pairs (as in ring attention: nothing
received is kept between forward and backward), and after each step the dK/dV partial sums of
the received chunks go back to their owner on the same pair, reversed (one message per step,
in the compute dtype). Gradients of the learnable tensors a score_mod closes over are summed
over the ranks (``all_reduce``), so every rank ends with the full gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .compute import Chunks, Spec, _partial, rows_of, run_steps, work_dtype
from .plan import Pair, Step
from .transport import Exchange, Pending

Tensor = torch.Tensor


def _pair_grads(
    spec: Spec,
    pair: Pair,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: tuple[Tensor, ...],
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dot: Tensor,
    dlse: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """``(dq, dk, dv, *dparams)`` of one pair; ``out``/``lse``/``dout``/``dot``/``dlse`` are
    the final values on the pair's query rows (``dot = rowsum(dout * out)``)."""
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad():
        o_i, l_i = _partial(spec, pair, qq, kk, vv)
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        w = torch.exp(l_i.detach() - safe)  # [B, Hq, n]: this pair's share of each row
        g_out = (w.unsqueeze(-1) * dout).to(o_i.dtype)
        g_lse = w * ((dout * o_i.detach()).sum(-1) - dot)
        if dlse is not None:
            g_lse = g_lse + w * dlse
        wrt = [qq, kk, vv, *params]
        grads = torch.autograd.grad(
            (o_i, l_i), wrt, (g_out, g_lse.to(l_i.dtype)), allow_unused=True
        )
    return grads


def backward(
    spec: Spec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: tuple[Tensor, ...],
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """``dq, dk, dv`` of this rank's shards (work dtype) and the all-reduced ``dparams``."""
    lay, rank = spec.layout, spec.rank
    wd = work_dtype(q.dtype)
    dout = dout.to(wd)
    dot = (dout * out).sum(-1)  # [B, Hq, L_local]
    dq = torch.zeros(q.shape, dtype=wd, device=q.device)
    dkv = torch.zeros(*k.shape[:3], k.shape[3] + v.shape[3], dtype=wd, device=k.device)
    # Contiguous whatever the tensor's own strides (zeros_like would keep a transposed
    # table's): they go to all_reduce, and NCCL takes only contiguous tensors.
    dparams = [torch.zeros(p.shape, dtype=wd, device=p.device) for p in params]
    D = k.shape[3]
    grad_ex = Exchange(spec.group, "backward")
    W = lay.world_size
    incoming: list[tuple[Step, Pending]] = []

    def visit(step: Step, ch: Chunks) -> None:
        acc = None if step.index and not step.recv else _grads_of(step, ch)
        if step.index == 0:
            return
        # dK/dV of the pieces this step received go back to their owner, and those of my
        # pieces the destination received come back: one batch, the step's ring reversed.
        tag = W + step.index
        sends = [(acc, step.recv_from, tag)] if acc is not None else []
        shape = (*k.shape[:2], rows_of(step.send), dkv.shape[3])
        recvs = [(shape, wd, k.device, step.send_to, tag)] if step.send else []
        got = grad_ex.post(sends, recvs, grads=True)
        if got:
            incoming.append((step, got[0]))

    def _grads_of(step: Step, ch: Chunks) -> Tensor:
        # Step 0 adds into this rank's own dK/dV; a received piece gets its own sums.
        acc = dkv if step.index == 0 else dkv.new_zeros(*ch.k.shape[:3], dkv.shape[3])
        for pair in step.pairs:
            a, n = lay.local_start(rank, pair.q_chunk), lay.chunk_len(pair.q_chunk)
            kj, vj = ch.kv(pair.keys.chunk)
            rows = slice(a, a + n)
            g = _pair_grads(
                spec,
                pair,
                q[:, :, rows].to(wd),
                kj.to(wd),
                vj.to(wd),
                params,
                out[:, :, rows],
                lse[:, :, rows],
                dout[:, :, rows],
                dot[:, :, rows],
                None if dlse is None else dlse[:, :, rows],
            )
            b, m = ch.offset(pair.keys.chunk), pair.keys.rows
            if g[0] is not None:
                dq[:, :, rows] += g[0]
            if g[1] is not None:
                acc[:, :, b : b + m, :D] += g[1]
            if g[2] is not None:
                acc[:, :, b : b + m, D:] += g[2]
            for i, gp in enumerate(g[3:]):
                if gp is not None:
                    dparams[i] += gp
        return acc

    run_steps(spec, Exchange(spec.group, "backward"), k, v, visit)
    for step, pending in incoming:
        got = pending.wait()
        off = 0
        for pc in step.send:
            a = lay.local_start(rank, pc.chunk) + pc.lo
            dkv[:, :, a : a + pc.rows] += got[:, :, off : off + pc.rows]
            off += pc.rows
    grad_ex.finish()
    for g in dparams:
        dist.all_reduce(g, group=spec.group)
    return dq, dkv[..., :D], dkv[..., D:], dparams

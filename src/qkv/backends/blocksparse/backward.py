"""Backward kernels of the block-sparse engine: recompute each piece from the saved global
``out`` and ``lse`` (O(n) memory), and add its exact share of the gradients.

Why pieces can be differentiated independently: with the *global* row statistics, a piece's
probabilities are ``P = exp(S - lse)`` and the softmax backward is
``dS = P * (dP - D)`` with ``D = rowsum(dO * out)`` — both depend on the other pieces only
through ``lse`` and ``out``, which are saved. A gradient flowing into ``lse`` itself adds
``dlse * P`` to ``dS``, i.e. it replaces ``D`` by ``D - dlse``.

The fused path calls torch's flash backward per piece (it computes ``D`` from the ``out`` it
is given, so ``dlse`` is folded in through one extra value column: ``v' = [v, 0]``,
``out' = [out, 1]``, ``dO' = [dO, -dlse]`` gives ``rowsum(dO' * out') = D - dlse`` and leaves
``dP`` and ``dv`` unchanged). The matmul path does the algebra itself and, for callable
score_mods, re-runs the score_mod on the piece under autograd to reach the score and any
tensor the score_mod closes over.
"""

from __future__ import annotations

import torch

from ..base import unit_last_stride
from .forward import float_mask, fold, pad_last, strided_blocks, unfold
from .grads import Grads, add_bias_grad, group_sum, lse_for_bwd, lse_hi_lo
from .job import Job, KeyBandGroup, Piece

Tensor = torch.Tensor

_flash_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def backward(
    job: Job,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    need: list[bool],
) -> Grads:
    """Gradients of one call. ``out [B, Hq, Lq, Dv]`` and ``lse [B, Hq, Lq]`` are the forward's
    results; ``dlse`` is ``None`` when nothing flowed into the lse."""
    if job.native_band is not None:  # the compiled band kernel ran the forward: its backward
        from . import native

        lse_hi, lse_lo = lse_hi_lo(lse, torch.float32)
        more = native.extras(job.p.mask.terms, job.p.B)
        dq, dk, dv = native.band_backward(
            q, k, v, out, dout, lse_hi, lse_lo, dlse, *job.native_band, job.p.scale, more
        )
        return Grads.of(job, dq, dk, dv)
    if job.fused:
        return _fused_backward(job, q, k, v, out, lse, dout, dlse, need)
    return _matmul_backward(job, q, k, v, out, lse, dout, dlse, need)


def _fused_backward(
    job: Job,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    need: list[bool],
) -> Grads:
    p = job.p
    D, Dv = p.D, p.Dv
    kdt = torch.float64 if q.dtype == torch.float64 else torch.float32  # the kernel's lse dtype
    lse_k = lse_for_bwd(lse).to(kdt)
    sched = job.bwd
    written: list[tuple[int, int]] = []
    # Backward schedules batch band rows key-major only (query-major band groups are a
    # forward schedule: see _blocksparse_plan._key_schedule).
    assert not sched.groups, "a backward schedule has query-major band groups"
    if not job.segments:  # key-major groups write their keys' dk, dv
        written = [(kg.j0 * kg.b, (kg.j0 + kg.n) * kg.b) for kg in sched.key_groups]
    g = Grads(job, q, k, v, need, tuple(sorted(written)))
    # torch's fused kernel reads the last dim as dense; an upstream gradient may be any view
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    dout = unit_last_stride(dout.to(q.dtype))
    out = unit_last_stride(out.to(q.dtype))
    if dlse is not None:
        # One extra value column carries -dlse into D (see the module docstring).
        v = torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1)  # [B, Hkv, Lk, Dv+1]
        out = torch.cat([out, torch.ones_like(out[..., :1])], dim=-1)  # [B, Hq, Lq, Dv+1]
        dout = torch.cat([dout, (-dlse).to(dout.dtype).unsqueeze(-1)], dim=-1)
    dm = max(D, v.shape[-1])
    qp, kp, vp = pad_last(q, dm), pad_last(k, dm), pad_last(v, dm)
    outp, doutp = pad_last(out, dm), pad_last(dout, dm)
    for q0, q1, k0, k1, causal in job.segments:
        dq, dk, dv = _flash_cpu_bwd(
            doutp[:, :, q0:q1],
            qp[:, :, q0:q1],
            kp[:, :, k0:k1],
            vp[:, :, k0:k1],
            outp[:, :, q0:q1],
            lse_k[:, :, q0:q1],
            0.0,
            causal,
            scale=p.scale,
        )
        g.dq[:, :, q0:q1] += dq[..., :D]
        g.dk[:, :, k0:k1] += dk[..., :D]
        g.dv[:, :, k0:k1] += dv[..., :Dv]
    if sched.key_groups:
        qp, kp, vp = qp.contiguous(), kp.contiguous(), vp.contiguous()
        outp, doutp, lse_k = outp.contiguous(), doutp.contiguous(), lse_k.contiguous()
        for kgrp in sched.key_groups:
            _key_group_backward(job, kgrp, g, qp, kp, vp, outp, doutp, lse_k, D, Dv)
    for pieces in sched.rows:
        for pc in pieces:
            r = slice(pc.q0, pc.q1)
            fm = float_mask(job, pc, job.piece_mask(pc, q.device), q.dtype)
            dq, dk, dv = _flash_cpu_bwd(
                doutp[:, :, r],
                qp[:, :, r],
                pc.keys(kp),
                pc.keys(vp),
                outp[:, :, r],
                lse_k[:, :, r],
                0.0,
                False,
                attn_mask=fm,
                scale=p.scale,
            )
            g.dq[:, :, r] += dq[..., :D]
            g.add_keys(g.dk, pc, dk[..., :D])
            g.add_keys(g.dv, pc, dv[..., :Dv])
    return g


def _key_group_backward(
    job: Job,
    grp: KeyBandGroup,
    g: Grads,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    dout: Tensor,
    lse: Tensor,
    D: int,
    Dv: int,
) -> None:
    """One key-major group's backward in a single fused call: each key block against its
    window of query rows. Its key blocks' dk and dv come out complete (nothing else in the
    schedule touches those keys); the windows' dq overlap and are added back one query-block
    offset at a time."""
    p = job.p
    fmask = job.key_group_mask(grp, q.device, q.dtype)
    b, n, rows = grp.b, grp.n, grp.w * grp.b
    first_k, first_q = grp.j0 * b, (grp.j0 + grp.c) * b
    dq, dk, dv = _flash_cpu_bwd(
        strided_blocks(dout, first_q, n, rows, b),
        strided_blocks(q, first_q, n, rows, b),
        strided_blocks(k, first_k, n, b, b),
        strided_blocks(v, first_k, n, b, b),
        strided_blocks(out, first_q, n, rows, b),
        strided_blocks(lse.unsqueeze(-1), first_q, n, rows, b).squeeze(-1),
        0.0,
        False,
        attn_mask=fmask,
        scale=p.scale,
    )  # [B*H, n, rows|b, Dm]
    strided_blocks(g.dk, first_k, n, b, b).copy_(dk[..., :D])
    strided_blocks(g.dv, first_k, n, b, b).copy_(dv[..., :Dv])
    for t in range(grp.w):
        strided_blocks(g.dq, first_q + t * b, n, b, b).add_(dq[:, :, t * b : (t + 1) * b, :D])


def _matmul_backward(
    job: Job,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    need: list[bool],
) -> Grads:
    p = job.p
    cdt = p.compute_dtype
    hkv = k.shape[1]
    g = Grads(job, q, k, v, need)
    lse_hi, lse_lo = lse_hi_lo(lse, cdt)
    for pieces in job.bwd.rows:
        if not pieces:
            continue
        r = slice(pieces[0].q0, pieces[0].q1)
        qb = q[:, :, r].to(cdt)  # [B, Hq, rows, D]
        do = dout[:, :, r].to(cdt)  # [B, Hq, rows, Dv]
        lse_r = (lse_hi[:, :, r].unsqueeze(-1), lse_lo[:, :, r].unsqueeze(-1))  # [B, Hq, rows, 1]
        # D = sum_j P_ij dP_ij - dlse_i for the row. Summed from the pieces' own P and dP
        # (rather than rowsum(dO * out)) so that every row of dS sums to zero to rounding, as
        # plain autograd's softmax backward does: gradients that add up whole rows (a
        # relative-position table's clamped edge, a key bias) then cancel as they should.
        # A row split into several pieces needs a first pass to add up its D.
        drow = torch.zeros_like(lse_r[0])
        if dlse is not None:
            drow = drow - dlse[:, :, r].to(cdt).unsqueeze(-1)
        if len(pieces) > 1:
            for pc in pieces:
                kb, vb = pc.keys(k).to(cdt), pc.keys(v).to(cdt)  # [B, Hkv, span, D|Dv]
                _, _, probs, dp = _piece_probs(job, pc, qb, kb, vb, do, lse_r, grad=False)
                drow = drow + (probs * dp).sum(dim=-1, keepdim=True)
        for pc in pieces:
            kb, vb = pc.keys(k).to(cdt), pc.keys(v).to(cdt)  # [B, Hkv, span, D|Dv]
            ds_raw = _piece_dscores(job, pc, g, qb, kb, vb, do, lse_r, drow, len(pieces) == 1)
            # S = scale * q kᵀ  →  dq = scale * dS k,  dk = scale * dSᵀ q (summed over the
            # query heads of each kv group per head first: see group_sum)
            g.dq[:, :, r] += unfold(fold(ds_raw, hkv) @ kb, p.Hq) * p.scale
            dk_h = ds_raw.transpose(-2, -1) @ qb  # [B, Hq, span, D], one per query head
            g.add_keys(g.dk, pc, group_sum(dk_h, hkv) * p.scale)
    return g


def _piece_probs(
    job: Job,
    pc: Piece,
    qb: Tensor,
    kb: Tensor,
    vb: Tensor,
    do: Tensor,
    lse: tuple[Tensor, Tensor],
    *,
    grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Recompute a piece: ``(s_raw, s, P, dP)`` where ``s_raw = q kᵀ * scale``, ``s`` the
    modified scores (with an autograd graph back to ``s_raw`` when ``grad`` and a callable
    score_mod), ``P = exp(s - lse)`` masked, and ``dP`` the gradient reaching ``P`` (after
    dropout's rescaling). All ``[B, Hq, rows, span]``."""
    p = job.p
    hkv = kb.shape[1]
    with torch.no_grad():
        s_raw = unfold(fold(qb, hkv) @ kb.transpose(-2, -1), p.Hq) * p.scale  # [B, Hq, rows, span]
    m = job.piece_mask(pc, qb.device)
    if job.score_mod is not None:
        with torch.enable_grad() if grad else torch.no_grad():
            s_raw.requires_grad_(grad)
            s = job.apply_score_mod(s_raw, pc)
    else:
        bias = job.bias_slice(pc)
        s = s_raw if bias is None else s_raw + bias.to(s_raw.dtype)
    with torch.no_grad():
        sm = s.detach()
        if m is not None:
            sm = sm.masked_fill(~m, float("-inf"))
        probs = torch.exp((sm - lse[0]) - lse[1])  # [B, Hq, rows, span]
        dp = unfold(fold(do, hkv) @ vb.transpose(-2, -1), p.Hq)  # [B, Hq, rows, span]
        if p.dropout_p > 0:
            keep = job.keep_mask(pc, tuple(probs.shape), probs.device)
            dp = dp * keep / (1.0 - p.dropout_p)
    return s_raw, s, probs, dp


def _piece_dscores(
    job: Job,
    pc: Piece,
    g: Grads,
    qb: Tensor,
    kb: Tensor,
    vb: Tensor,
    do: Tensor,
    lse: tuple[Tensor, Tensor],
    drow: Tensor,
    single: bool,
) -> Tensor:
    """Recompute one piece and return the gradient of its raw scaled scores ``q kᵀ * scale``
    ``[B, Hq, rows, span]``; adds the piece's ``dv``, ``dbias`` and score_mod parameter grads.
    ``drow`` is ``-dlse`` for a row of one piece (its ``sum P dP`` is added here), else the
    row's complete ``D``."""
    p = job.p
    hkv = kb.shape[1]
    s_raw, s, probs, dp = _piece_probs(job, pc, qb, kb, vb, do, lse, grad=True)
    with torch.no_grad():
        if single:
            drow = drow + (probs * dp).sum(dim=-1, keepdim=True)
        pd = probs
        if p.dropout_p > 0:
            pd = probs * job.keep_mask(pc, tuple(probs.shape), probs.device) / (1.0 - p.dropout_p)
        dv_h = pd.transpose(-2, -1) @ do  # [B, Hq, span, Dv], one per query head
        g.add_keys(g.dv, pc, group_sum(dv_h, hkv))
        ds = probs * (dp - drow)  # [B, Hq, rows, span]; 0 wherever P is 0 (hidden keys)
    if g.dbias is not None:
        add_bias_grad(job, pc, g.dbias, ds)
    if job.score_mod is None:
        return ds
    wrt = [s_raw, *job.params]
    grads = torch.autograd.grad(s, wrt, ds, allow_unused=True)
    for i, gp in enumerate(grads[1:]):
        if gp is not None:
            prev = g.dparams[i]
            g.dparams[i] = gp if prev is None else prev + gp
    return grads[0] if grads[0] is not None else torch.zeros_like(ds)

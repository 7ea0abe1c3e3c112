"""Forward kernels of the block-sparse engine: one piece (a query block against a run of its
visible keys) at a time, merged per query block by log-sum-exp.

The compiled band kernel (``native``, ``kernels/band.cpp``) computes a sliding
window's whole forward in one call when the plan chose it. Otherwise, two kernel families:

- **fused** (CPU): torch's flash-attention CPU kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``), which returns the log-sum-exp and
  handles GQA natively; masks and float biases become its additive float mask.
- **matmul** (any device; score_mods, dropout, biases that need a gradient): explicit
  ``q @ kᵀ``, score_mod, mask, softmax and ``p @ v`` on one piece, in float32 (float64 for
  float64 inputs).
"""

from __future__ import annotations

import torch

from ..base import fused_cpu_mask, unit_last_stride
from .job import BandGroup, Job, Piece, Segment

Tensor = torch.Tensor

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def pad_last(t: Tensor, width: int) -> Tensor:
    """``t [..., X]`` zero-padded to ``[..., width]`` (the fused kernel needs Dv == D)."""
    if t.shape[-1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def fold(t: Tensor, hkv: int) -> Tensor:
    """``[B, Hq, L, X]`` → ``[B, Hkv, g*L, X]``: query heads sharing a kv head side by side, so
    one batched matmul serves a whole group (grouped-query attention)."""
    B, Hq, L, X = t.shape
    if Hq == hkv:
        return t
    return t.reshape(B, hkv, (Hq // hkv) * L, X)  # [B, Hkv, g*L, X]


def unfold(t: Tensor, hq: int) -> Tensor:
    """Inverse of :func:`fold`: ``[B, Hkv, g*L, X]`` → ``[B, Hq, L, X]``."""
    B, Hkv, GL, X = t.shape
    if hq == Hkv:
        return t
    return t.reshape(B, hq, GL // (hq // Hkv), X)  # [B, Hq, L, X]


def float_mask(job: Job, pc: Piece, m: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The fused kernel's additive mask for a piece: bias (if any) and -inf where hidden."""
    bias = job.bias_slice(pc)
    if m is None and bias is None:
        return None
    rows = pc.q1 - pc.q0
    if bias is None:
        assert m is not None
        fm = torch.zeros(m.shape, dtype=dtype, device=m.device)
    else:
        fm = bias.to(dtype)
        if m is not None:
            lead = torch.broadcast_shapes(fm.shape, m.shape)
            fm = fm.expand(lead)
        fm = fm.expand(*fm.shape[:2], rows, pc.span)
    if m is not None:
        fm = fm.masked_fill(~m, float("-inf"))
    return fm


def dead_rows(fm: Tensor | None) -> Tensor | None:
    """Rows of a piece whose every key is hidden: ``[b', h', rows, 1]`` bool, or ``None``."""
    if fm is None:
        return None
    return torch.isneginf(fm).all(dim=-1, keepdim=True)


def fused_piece(job: Job, pc: Piece, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """One piece with the fused CPU kernel. ``q, k, v`` are already padded to one head dim.
    Returns ``out [B, Hq, rows, Dm]`` (q's dtype) and ``lse [B, Hq, rows]``."""
    p = job.p
    qb = q[:, :, pc.q0 : pc.q1]  # [B, Hq, rows, Dm]
    kb, vb = pc.keys(k), pc.keys(v)  # [B, Hkv, span, Dm]
    fm = float_mask(job, pc, job.piece_mask(pc, q.device), q.dtype)
    am, _ = fused_cpu_mask(q, pc.q1 - pc.q0, pc.span, fm, False)
    out, lse = _flash_cpu(qb, kb, vb, 0.0, False, attn_mask=am, scale=p.scale)
    dead = dead_rows(fm)
    if dead is not None and bool(dead.any()):
        # The kernel reports lse 0 for a row with no visible key; the contract says -inf.
        lse = lse.masked_fill(dead.squeeze(-1).expand_as(lse), float("-inf"))
    return out, lse


def matmul_piece(job: Job, pc: Piece, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """One piece with explicit matmuls in the compute dtype. Written without in-place ops on
    inputs so that autograd can differentiate it (the checkpointed fallback uses that).
    Returns ``out [B, Hq, rows, Dv]`` in the compute dtype and ``lse [B, Hq, rows]`` in
    float64 (see :func:`softmax_lse`)."""
    p = job.p
    cdt = p.compute_dtype
    hkv = k.shape[1]
    qb = q[:, :, pc.q0 : pc.q1].to(cdt)  # [B, Hq, rows, D]
    kb, vb = pc.keys(k).to(cdt), pc.keys(v).to(cdt)  # [B, Hkv, span, D|Dv]
    s = unfold(fold(qb, hkv) @ kb.transpose(-2, -1), p.Hq) * p.scale  # [B, Hq, rows, span]
    s = scores_mod(job, pc, s)
    m = job.piece_mask(pc, q.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    probs, lse = softmax_lse(s)
    if p.dropout_p > 0:
        keep = job.keep_mask(pc, tuple(probs.shape), probs.device)
        probs = probs * keep / (1.0 - p.dropout_p)
    out = unfold(fold(probs, hkv) @ vb, p.Hq)  # [B, Hq, rows, Dv]
    return out, lse


def scores_mod(job: Job, pc: Piece, s: Tensor) -> Tensor:
    """Apply the problem's bias or callable score_mod to a piece's scaled scores."""
    bias = job.bias_slice(pc)
    if bias is not None:
        return s + bias.to(s.dtype)
    if job.score_mod is not None:
        return job.apply_score_mod(s, pc)
    return s


def softmax_lse(s: Tensor) -> tuple[Tensor, Tensor]:
    """Row softmax of ``s [..., span]`` and its log-sum-exp, with rows that are all ``-inf``
    giving probabilities 0 and lse ``-inf`` (never NaN).

    The lse is returned in float64: ``max + log(sum)`` rounded to float32 loses up to half an
    ulp of the max (5e-4 at scores of 1e4), and the backward's ``exp(s - lse)`` would carry
    that error into every gradient. Kept exact, the recomputed probabilities match these."""
    mx = s.detach().amax(dim=-1, keepdim=True)  # [..., 1]
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx)
    # The row sum in float64 too: the backward recomputes P = exp(s - lse) without dividing
    # by a row sum, so an lse off by the float32 sum's rounding (~1e-7 relative) leaves rows of
    # P summing to 1 + 1e-7 and dS rows to D * 1e-7, which gradients weighting whole rows
    # (an ALiBi slope: sum of dS * (kv - q)) multiply by the distance: 7x plain PyTorch's
    # error at Lq=113, Lk=256.
    den64 = e.sum(dim=-1, keepdim=True, dtype=torch.float64)  # [..., 1]
    dead = den64 == 0  # no visible key; a NaN score leaves den64 NaN, and NaN it stays
    safe64 = torch.where(dead, torch.ones_like(den64), den64)
    lse = torch.log(safe64) + mx.double()
    lse = torch.where(dead, torch.full_like(lse, float("-inf")), lse)
    return e / safe64.to(e.dtype), lse.squeeze(-1)


def merge(acc: tuple[Tensor, Tensor] | None, new: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial results ``(out [..., rows, Dv], lse [..., rows])``
    over disjoint key sets (FlashAttention's rescaling). Differentiable; never NaN."""
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    lse = torch.logaddexp(l1, l2)
    # Only rows that see no key in either part get weight 0; a NaN lse gives NaN weights, so
    # a NaN in one part reaches the merged row instead of vanishing.
    dead = torch.isneginf(lse)
    ref = torch.where(dead, torch.zeros_like(lse), lse)
    w1 = torch.where(dead, torch.zeros_like(lse), torch.exp(l1 - ref)).unsqueeze(-1)
    w2 = torch.where(dead, torch.zeros_like(lse), torch.exp(l2 - ref)).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def row_forward(
    job: Job, pieces: list[Piece], q: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor]:
    """All pieces of one query block, merged: ``out [B, Hq, rows, X]``, ``lse [B, Hq, rows]``
    (float64). Fused single pieces stay in q's dtype; merged ones are in the compute dtype."""
    cdt = job.p.compute_dtype
    kernel = fused_piece if job.fused else matmul_piece
    if len(pieces) == 1:
        o, lse = kernel(job, pieces[0], q, k, v)
        return o, lse.double()
    acc: tuple[Tensor, Tensor] | None = None
    for pc in pieces:
        o, lse = kernel(job, pc, q, k, v)
        acc = merge(acc, (o.to(cdt), lse.double()))
    assert acc is not None
    return acc


def strided_blocks(t: Tensor, first: int, n: int, rows: int, step: int) -> Tensor:
    """``n`` windows of ``rows`` positions of ``t [B, H, L, X]`` (contiguous), starting at
    position ``first`` and ``step`` apart, as a ``[B*H, n, rows, X]`` view (windows may
    overlap). The fused kernel reads them as a batch of B*H and n "heads"."""
    B, H, L, X = t.shape
    return t.as_strided(
        (B * H, n, rows, X), (L * X, step * X, X, 1), t.storage_offset() + first * X
    )


def group_forward(
    job: Job, g: BandGroup, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
) -> None:
    """One band group: a single fused call over strided views; writes ``out`` and ``lse``."""
    p = job.p
    fmask, dead = job.group_mask(g, q.device, q.dtype)
    span = g.w * g.b
    qg = strided_blocks(q, g.i0 * g.b, g.n, g.b, g.b)  # [B*H, n, b, Dm]
    kg = strided_blocks(k, (g.i0 + g.c) * g.b, g.n, span, g.b)  # [B*H, n, span, Dm]
    vg = strided_blocks(v, (g.i0 + g.c) * g.b, g.n, span, g.b)  # [B*H, n, span, Dm]
    am, _ = fused_cpu_mask(q, g.b, span, fmask, False)
    o, l_ = _flash_cpu(qg, kg, vg, 0.0, False, attn_mask=am, scale=p.scale)
    if dead is not None:
        l_ = l_.masked_fill(dead.view(1, 1, g.b).expand_as(l_), float("-inf"))
    strided_blocks(out, g.i0 * g.b, g.n, g.b, g.b).copy_(o[..., : out.shape[-1]])
    strided_blocks(lse.unsqueeze(-1), g.i0 * g.b, g.n, g.b, g.b).copy_(l_.unsqueeze(-1))


def _segment(q: Tensor, k: Tensor, v: Tensor, seg: Segment, scale: float) -> tuple[Tensor, Tensor]:
    """One mask-free segment (rows ``q0:q1`` against keys ``k0:k1``, causal or not) with the
    fused kernel: ``out [B, Hq, rows, Dm]``, ``lse [B, Hq, rows]``."""
    q0, q1, k0, k1, causal = seg
    am, causal = fused_cpu_mask(q, q1 - q0, k1 - k0, None, causal)
    qs, ks, vs = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]  # [B, H, rows|keys, Dm]
    return _flash_cpu(qs, ks, vs, 0.0, causal, attn_mask=am, scale=scale)


def forward(job: Job, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The whole call: ``out [B, Hq, Lq, Dv]`` in q's dtype and ``lse [B, Hq, Lq]`` in
    float64 (``-inf`` on rows with no visible key)."""
    p = job.p
    B, Hq, Lq, Dv = p.B, p.Hq, p.Lq, p.Dv
    if job.native_band is not None:
        from . import native

        more = native.extras(p.mask.terms, B)
        out, lse32 = native.band_forward(q, k, v, *job.native_band, p.scale, more)
        return out, lse32.double()
    if job.fused:  # torch's fused kernel: one head dim, and a dense last dim
        dm = max(p.D, p.Dv)
        q, k, v = (unit_last_stride(pad_last(t, dm)) for t in (q, k, v))
    if len(job.segments) == 1 and job.segments[0][:4] == (0, Lq, 0, p.Lk):
        out, lse = _segment(q, k, v, job.segments[0], p.scale)
        return out[..., :Dv], lse.double()
    rows, groups = job.fwd.rows, job.fwd.groups
    # Rows that nothing writes see no key: output 0 (filled below), lse -inf.
    out = q.new_empty(B, Hq, Lq, Dv)
    lse = torch.full((B, Hq, Lq), float("-inf"), dtype=torch.float64, device=q.device)
    written = torch.zeros(Lq, dtype=torch.bool)
    acc: tuple[Tensor, Tensor] | None = None
    for i, seg in enumerate(job.segments):
        q0, q1 = seg[:2]
        o, l_ = _segment(q, k, v, seg, p.scale)
        nxt = job.segments[i + 1] if i + 1 < len(job.segments) else None
        if acc is not None or (nxt is not None and nxt[:2] == (q0, q1)):
            # Several segments over these rows: merge them in the compute dtype.
            acc = merge(acc, (o.to(p.compute_dtype), l_.double()))
            if nxt is not None and nxt[:2] == (q0, q1):
                continue
            o, l_ = acc
            acc = None
        out[:, :, q0:q1] = o[..., :Dv]
        lse[:, :, q0:q1] = l_
        written[q0:q1] = True
    if groups:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        for g in groups:
            group_forward(job, g, q, k, v, out, lse)
            written[g.i0 * g.b : (g.i0 + g.n) * g.b] = True
    for pieces in rows:
        if not pieces:
            continue  # a query block that sees nothing (or one a band group computed)
        q0, q1 = pieces[0].q0, pieces[0].q1
        o, l_ = row_forward(job, pieces, q, k, v)
        out[:, :, q0:q1] = o[..., :Dv]
        lse[:, :, q0:q1] = l_
        written[q0:q1] = True
    if not bool(written.all()):
        out[:, :, ~written.to(out.device)] = 0
    return out, lse

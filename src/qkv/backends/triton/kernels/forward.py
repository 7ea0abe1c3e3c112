"""The forward kernel: one program per (query block, batch x head), online softmax over
the key blocks its list names."""

from __future__ import annotations

import triton
import triton.language as tl

from .parts import DYNAMIC, mask, score


@triton.jit(do_not_specialize=DYNAMIC)
def attn_fwd(
    Q,
    K,
    V,
    O,
    LSE,
    NUM,
    IDX,
    TAG,
    START,
    LIMIT,
    IDS,
    sid,
    BITS,
    BIAS,
    SLOPES,
    TABLE,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    som,
    sbb,
    sbh,
    sbm,
    sbn,
    st0,
    st1,
    H,
    G,
    Lq,
    Lk,
    W,
    list_b,
    list_h,
    n_blocks,
    scale,
    lo,
    hi,
    prefix,
    cap,
    R,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_BAND: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SCORE: tl.constexpr,
    MMA: tl.constexpr,
    PV_F32: tl.constexpr,
):
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = qb * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    q = tl.load(
        q_ptr + offs_m[:, None] * sqm + offs_d[None, :],
        mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D),
        other=0.0,
    )
    k_ptr = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_ptr = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    row = b * list_b + h * list_h + qb
    n = tl.load(NUM + row)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_DV], tl.float32)
    for j in range(0, n):
        kb = tl.load(IDX + row.to(tl.int64) * W + j)
        tag = tl.load(TAG + row.to(tl.int64) * W + j)
        offs_n = kb * BN + tl.arange(0, BN)
        kt = tl.load(
            k_ptr + offs_n[None, :] * skn + offs_d[:, None],
            mask=(offs_n[None, :] < Lk) & (offs_d[:, None] < D),
            other=0.0,
        )  # [BLOCK_D, BN]
        s = tl.dot(q.to(MMA), kt.to(MMA), input_precision="ieee") * scale
        ok = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
        s = score(
            s,
            b,
            h,
            offs_m,
            offs_n,
            ok,
            BIAS,
            sbb,
            sbh,
            sbm,
            sbn,
            SLOPES,
            TABLE,
            st0,
            st1,
            cap,
            R,
            SCORE,
        )
        if tag >= 0:
            ok = mask(
                ok,
                b,
                offs_m,
                offs_n,
                tag,
                lo,
                hi,
                prefix,
                START,
                LIMIT,
                IDS,
                sid,
                BITS,
                Lq,
                Lk,
                HAS_BAND,
                HAS_PREFIX,
                HAS_PAD,
                HAS_DOC,
                HAS_BITS,
                BM,
                BN,
            )
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + offs_n[:, None] * svn + offs_dv[None, :],
            mask=(offs_n[:, None] < Lk) & (offs_dv[None, :] < DV),
            other=0.0,
        )  # [BN, BLOCK_DV]
        if PV_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype).to(MMA), v.to(MMA), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    dead = l_i == 0.0  # no visible key; a NaN score leaves l_i NaN, and the row NaN
    out = acc / tl.where(dead, 1.0, l_i)[:, None]
    o_ptr = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(
        o_ptr + offs_m[:, None] * som + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < DV),
    )
    lse = tl.where(dead, float("-inf"), m_i + tl.log(tl.where(dead, 1.0, l_i)))
    tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, lse, mask=offs_m < Lq)

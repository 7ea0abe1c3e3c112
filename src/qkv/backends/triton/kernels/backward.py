"""The backward kernels: dK/dV per key block (over the query blocks that see it, a kv
head's whole group in one program) and dQ per query block, with the score tensors'
gradients by atomic adds."""

from __future__ import annotations

import triton
import triton.language as tl

from .parts import DYNAMIC, probs, through_score


@triton.jit(do_not_specialize=DYNAMIC)
def attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
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
    sdob,
    sdoh,
    sdom,
    sbb,
    sbh,
    sbm,
    sbn,
    st0,
    st1,
    H,
    HKV,
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
    DV_: tl.constexpr,
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
):
    kb = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // HKV
    hk = bhk % HKV
    offs_n = kb * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ptr = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_ptr = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    kt = tl.load(
        k_ptr + offs_n[None, :] * skn + offs_d[:, None],
        mask=(offs_n[None, :] < Lk) & (offs_d[:, None] < D),
        other=0.0,
    )  # [BLOCK_D, BN]
    vt = tl.load(
        v_ptr + offs_n[None, :] * svn + offs_dv[:, None],
        mask=(offs_n[None, :] < Lk) & (offs_dv[:, None] < DV_),
        other=0.0,
    )  # [BLOCK_DV, BN]
    dk = tl.zeros([BN, BLOCK_D], tl.float32)
    dv = tl.zeros([BN, BLOCK_DV], tl.float32)
    for g in range(0, G):
        h = hk * G + g
        q_ptr = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_ptr = DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
        bh = b * H + h
        row = b * list_b + h * list_h + kb
        n = tl.load(NUM + row)
        for j in range(0, n):
            qb = tl.load(IDX + row.to(tl.int64) * W + j)
            tag = tl.load(TAG + row.to(tl.int64) * W + j)
            offs_m = qb * BM + tl.arange(0, BM)
            q = tl.load(
                q_ptr + offs_m[:, None] * sqm + offs_d[None, :],
                mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D),
                other=0.0,
            )
            do = tl.load(
                do_ptr + offs_m[:, None] * sdom + offs_dv[None, :],
                mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < DV_),
                other=0.0,
            )
            lse = tl.load(LSE + bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows that saw no key: p = 0
            delta = tl.load(DELTA + bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=0.0)
            p, raw, _ok = probs(
                q,
                kt,
                b,
                h,
                offs_m,
                offs_n,
                lse,
                tag,
                scale,
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
                SCORE,
                BM,
                BN,
                MMA,
            )
            dv += tl.dot(tl.trans(p.to(do.dtype)).to(MMA), do.to(MMA), input_precision="ieee")
            dp = tl.dot(do.to(MMA), vt.to(MMA), input_precision="ieee")  # [BM, BN]
            ds = through_score(p * (dp - delta[:, None]), raw, cap, SCORE)
            dk += tl.dot(tl.trans(ds.to(q.dtype)).to(MMA), q.to(MMA), input_precision="ieee")
    dk = dk * scale
    mask_k = offs_n[:, None] < Lk
    dk_ptr = DK + bhk.to(tl.int64) * Lk * D
    tl.store(
        dk_ptr + offs_n[:, None] * D + offs_d[None, :], dk, mask=mask_k & (offs_d[None, :] < D)
    )
    dv_ptr = DV + bhk.to(tl.int64) * Lk * DV_
    tl.store(
        dv_ptr + offs_n[:, None] * DV_ + offs_dv[None, :],
        dv,
        mask=mask_k & (offs_dv[None, :] < DV_),
    )


@triton.jit(do_not_specialize=DYNAMIC)
def attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DPARAM,
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
    sdob,
    sdoh,
    sdom,
    sbb,
    sbh,
    sbm,
    sbn,
    st0,
    st1,
    sgb,
    sgh,
    sgm,
    sgn,
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
    DV_: tl.constexpr,
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
    PARAM_GRAD: tl.constexpr,
    MMA: tl.constexpr,
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
    do_ptr = DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
    do = tl.load(
        do_ptr + offs_m[:, None] * sdom + offs_dv[None, :],
        mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < DV_),
        other=0.0,
    )
    lse = tl.load(LSE + bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=0.0)
    k_ptr = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_ptr = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    row = b * list_b + h * list_h + qb
    n = tl.load(NUM + row)
    dq = tl.zeros([BM, BLOCK_D], tl.float32)
    dslope = tl.sum(tl.zeros([BM], tl.float32), 0)  # a float32 scalar carried by the loop
    for j in range(0, n):
        kb = tl.load(IDX + row.to(tl.int64) * W + j)
        tag = tl.load(TAG + row.to(tl.int64) * W + j)
        offs_n = kb * BN + tl.arange(0, BN)
        kt = tl.load(
            k_ptr + offs_n[None, :] * skn + offs_d[:, None],
            mask=(offs_n[None, :] < Lk) & (offs_d[:, None] < D),
            other=0.0,
        )  # [BLOCK_D, BN]
        vt = tl.load(
            v_ptr + offs_n[None, :] * svn + offs_dv[:, None],
            mask=(offs_n[None, :] < Lk) & (offs_dv[:, None] < DV_),
            other=0.0,
        )  # [BLOCK_DV, BN]
        p, raw, ok = probs(
            q,
            kt,
            b,
            h,
            offs_m,
            offs_n,
            lse,
            tag,
            scale,
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
            SCORE,
            BM,
            BN,
            MMA,
        )
        dp = tl.dot(do.to(MMA), vt.to(MMA), input_precision="ieee")  # [BM, BN]
        dmod = p * (dp - delta[:, None])  # dL / d(modified score)
        if PARAM_GRAD:
            if SCORE == 1:  # a bias: its gradient is dL/d(score), summed where it broadcasts
                ptr = DPARAM + b * sgb + h * sgh + offs_m[:, None] * sgm + offs_n[None, :] * sgn
                tl.atomic_add(ptr, dmod, mask=ok)
            if SCORE == 2:
                dist = (offs_n[None, :] - offs_m[:, None]).to(tl.float32)
                dslope += tl.sum(tl.sum(tl.where(ok, dmod * dist, 0.0), 1), 0)
            if SCORE == 4:
                rel = tl.minimum(tl.maximum(offs_m[:, None] - offs_n[None, :], -R), R) + R
                tl.atomic_add(DPARAM + rel * st0 + h * st1, dmod, mask=ok)
        ds = through_score(dmod, raw, cap, SCORE)
        dq += tl.dot(ds.to(kt.dtype).to(MMA), tl.trans(kt).to(MMA), input_precision="ieee")
    if PARAM_GRAD and SCORE == 2:
        tl.atomic_add(DPARAM + h, dslope)
    dq = dq * scale
    dq_ptr = DQ + bh.to(tl.int64) * Lq * D
    tl.store(
        dq_ptr + offs_m[:, None] * D + offs_d[None, :],
        dq,
        mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D),
    )

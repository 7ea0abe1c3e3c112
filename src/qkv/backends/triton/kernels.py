"""The Triton kernels of ``backend="triton"``: a FlashAttention-2 forward and backward that
walk a block-sparse plan.

Each program owns one tile row: a query block (forward, dQ) or a key block (dK/dV), and loops
over the blocks its list names (``num [Bm, Hm, n]``, ``idx`` / ``tag [Bm, Hm, n, W]``; ``Bm``
and ``Hm`` are 1 where the mask is the same for every batch element / head, reached through a
zero stride). A tag of -1 marks a full tile: no mask is evaluated. A tag >= 0 marks a partial
tile, masked in the kernel by the built-in masks' parameters (``HAS_BAND``: ``lo <= kv - q <=
hi``; ``HAS_PREFIX``: ``kv < prefix`` or causal; ``HAS_PAD``: ``start[b] <= kv < limit[b]``;
``HAS_DOC``: ``ids[q] == ids[kv]``, all and-ed), or by bit-packed tile ``tag`` of ``BITS``
(``[T, BM, BN // 32]`` int32 words) for any other mask: those are evaluated ahead, in
PyTorch, for the partial tiles only, so no user code is compiled.

Scores follow qkv's contract: ``s = (q . k) * scale``, then the score mod (``SCORE``: 0 none,
1 an additive bias tensor, 2 ALiBi, 3 softcap, 4 relative-position table), then the mask. The
softmax is online in float32 (``exp``, natural log-sum-exp); a row that sees no key gives 0
and lse ``-inf``. Matrix products accumulate in float32 with ``input_precision="ieee"`` (no
TF32 on float32 inputs: the contract is float32 arithmetic).

The layout follows Triton's fused-attention tutorial and FlashAttention-2 (Dao, 2023): the
backward recomputes the probabilities from the saved lse; dK/dV loop over the query blocks
that see a key block (the transposed lists), dQ over the key blocks a query block sees; a
grouped-query key/value head sums over its group's query heads in one program (no copies,
no atomics). Learnable score-mod tensors (ALiBi slopes, the relative table) get their
gradient by atomic adds in the dQ kernel, as does a bias tensor (summed over the dimensions
it broadcasts over).

This file is imported only when the backend runs (``TRITON_INTERPRET=1`` is read by
``triton.jit`` at import, which is how the tests run these kernels on a CPU).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# triton.jit reads TRITON_INTERPRET when it decorates: this module's kernels are interpreted
# for the life of the process when it was set at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Runtime integers that change with the problem: not specialised, so a new length, window or
# list width reuses the compiled kernel instead of compiling again.
_DYNAMIC = [
    "Lq",
    "Lk",
    "W",
    "list_b",
    "list_h",
    "lo",
    "hi",
    "prefix",
    "R",
    "n_blocks",
]


@triton.jit
def _score(
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
    SCORE: tl.constexpr,
):
    """The score mod on scaled scores ``s [BM, BN]`` (returns the modified scores)."""
    if SCORE == 1:
        ptr = BIAS + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :] * sbn
        s = s + tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    elif SCORE == 2:
        slope = tl.load(SLOPES + h).to(tl.float32)
        s = s + slope * (offs_n[None, :] - offs_m[:, None]).to(tl.float32)
    elif SCORE == 3:
        s = cap * _tanh(s / cap)
    elif SCORE == 4:
        rel = tl.minimum(tl.maximum(offs_m[:, None] - offs_n[None, :], -R), R) + R
        s = s + tl.load(TABLE + rel * st0 + h * st1, mask=ok, other=0.0).to(tl.float32)
    return s


@triton.jit
def _tanh(x):
    # tanh through exp (libdevice's tanh is not in the interpreter): exact to float32 ulps
    # of the result's scale, which is what the softcapped score needs.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _mask(
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
    BITS,
    Lq,
    Lk,
    HAS_BAND: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_BITS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """``ok [BM, BN]`` and-ed with the mask of a partial tile."""
    d = offs_n[None, :] - offs_m[:, None]
    if HAS_BAND:
        ok = ok & (d >= lo) & (d <= hi)
    if HAS_PREFIX:
        ok = ok & ((offs_n[None, :] < prefix) | (d <= 0))
    if HAS_PAD:
        start = tl.load(START + b)
        limit = tl.load(LIMIT + b)
        ok = ok & (offs_n[None, :] >= start) & (offs_n[None, :] < limit)
    if HAS_DOC:
        qid = tl.load(IDS + offs_m, mask=offs_m < Lq, other=-1)
        kid = tl.load(IDS + offs_n, mask=offs_n < Lk, other=-2)
        ok = ok & (qid[:, None] == kid[None, :])
    if HAS_BITS:
        rows = tl.arange(0, BM)
        cols = tl.arange(0, BN)
        words = tl.load(
            BITS
            + tag.to(tl.int64) * (BM * (BN // 32))
            + rows[:, None] * (BN // 32)
            + cols[None, :] // 32
        )
        ok = ok & (((words >> (cols[None, :] % 32)) & 1) != 0)
    return ok


@triton.jit(do_not_specialize=_DYNAMIC)
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
        s = _score(
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
            ok = _mask(
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
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptr = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(
        o_ptr + offs_m[:, None] * som + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < DV),
    )
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, lse, mask=offs_m < Lq)


@triton.jit
def _probs(
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
    BITS,
    Lq,
    Lk,
    HAS_BAND: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SCORE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    MMA: tl.constexpr,
):
    """Recomputed ``(p, raw, ok)`` of one tile in the backward: the probabilities, the scaled
    scores before the score mod (softcap's derivative needs them) and the mask."""
    raw = tl.dot(q.to(MMA), kt.to(MMA), input_precision="ieee") * scale
    ok = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
    s = _score(
        raw,
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
        ok = _mask(
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
    p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
    return p, raw, ok


@triton.jit
def _through_score(ds, raw, cap, SCORE: tl.constexpr):
    """dL/d(raw scaled score) from dL/d(modified score): only softcap changes it."""
    if SCORE == 3:
        t = _tanh(raw / cap)
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit(do_not_specialize=_DYNAMIC)
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
            p, raw, _ok = _probs(
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
            ds = _through_score(p * (dp - delta[:, None]), raw, cap, SCORE)
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


@triton.jit(do_not_specialize=_DYNAMIC)
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
        p, raw, ok = _probs(
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
        ds = _through_score(dmod, raw, cap, SCORE)
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

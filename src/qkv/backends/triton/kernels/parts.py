"""The pieces the kernels share: the score mod, the in-kernel mask, recomputed
probabilities and the score mod's derivative (see the package docstring)."""

from __future__ import annotations

import triton
import triton.language as tl

DYNAMIC = [
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
    "sid",
]


@triton.jit
def score(
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
        s = cap * tanh(s / cap)
    elif SCORE == 4:
        rel = tl.minimum(tl.maximum(offs_m[:, None] - offs_n[None, :], -R), R) + R
        s = s + tl.load(TABLE + rel * st0 + h * st1, mask=ok, other=0.0).to(tl.float32)
    return s


@triton.jit
def tanh(x):
    # tanh through exp (libdevice's tanh is not in the interpreter): exact to float32 ulps
    # of the result's scale, which is what the softcapped score needs.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def mask(
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
        ids = IDS + b.to(tl.int64) * sid  # batch b's row of ids (sid 0: one shared row)
        qid = tl.load(ids + offs_m, mask=offs_m < Lq, other=-1)
        kid = tl.load(ids + offs_n, mask=offs_n < Lk, other=-2)
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


@triton.jit
def probs(
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
    s = score(
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
    p = tl.exp(tl.where(ok, s, float("-inf")) - lse[:, None])  # masked: exp(-inf) = 0
    return p, raw, ok


@triton.jit
def through_score(ds, raw, cap, SCORE: tl.constexpr):
    """dL/d(raw scaled score) from dL/d(modified score): only softcap changes it."""
    if SCORE == 3:
        t = tanh(raw / cap)
        ds = ds * (1.0 - t * t)
    return ds

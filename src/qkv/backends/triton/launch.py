"""Launching the Triton kernels: tilings, argument packing, and the autograd Function.

Three layers (STYLE.md rule 7): :class:`qkv.backends.triton.TritonBackend` →
:class:`TritonAttention`
(this file) → the kernels (``kernels.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..._problem import Problem
from .lists import MaskSpec, TileLists

Tensor = torch.Tensor

SCORE_CODES = {"none": 0, "bias": 1, "alibi": 2, "softcap": 3, "relative": 4}


@dataclass(frozen=True)
class Tiling:
    """Tile sizes and launch shape of one kernel: ``bq x bk`` positions a program step."""

    bq: int
    bk: int
    warps: int = 4
    stages: int = 2


@dataclass(frozen=True)
class Tilings:
    fwd: Tiling
    bwd: Tiling  # dK/dV and dQ share one tiling, so they share one set of lists


def interpreted() -> bool:
    """True when the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they
    were first imported; read from the environment until then)."""
    import sys

    mod = sys.modules.get(__name__.rsplit(".", 1)[0] + ".kernels")
    if mod is not None:
        return bool(getattr(mod, "INTERPRETED", False))
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tilings(p: Problem) -> Tilings:
    """The tiles for a problem. In the interpreter small tiles keep tests quick and still put
    several blocks in short sequences. On a GPU, FlashAttention-2's (Triton tutorial) choices
    for Hopper-class parts: 128-row query tiles forward, 64 x 64 backward; head dims above 128
    halve the tiles to fit shared memory. (Untuned: no GPU has run them yet.)"""
    if interpreted():
        # The interpreter's cost is per tile operation: long sequences take bigger tiles.
        t = Tiling(16, 32, 1, 1) if p.Lq * p.Lk <= 1 << 12 else Tiling(128, 128, 1, 1)
        return Tilings(fwd=t, bwd=t)
    d = max(p.D, p.Dv)
    if d <= 64:
        return Tilings(fwd=Tiling(128, 64, 4, 3), bwd=Tiling(64, 64, 4, 2))
    if d <= 128:
        return Tilings(fwd=Tiling(128, 64, 8, 3), bwd=Tiling(64, 64, 8, 2))
    return Tilings(fwd=Tiling(64, 32, 4, 2), bwd=Tiling(32, 32, 4, 1))


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, (n - 1).bit_length()))


@dataclass(frozen=True, eq=False)
class Call:
    """Everything one call's kernels read besides q, k, v and the score tensors."""

    p: Problem
    spec: MaskSpec
    fwd: TileLists
    bwd_lists: Any  # () -> TileLists: the backward's lists, built when a backward runs
    tiles: Tilings


def _mask_args(p: Problem, spec: MaskSpec, lists: TileLists) -> list[Any]:
    dev = p.device
    dummy = torch.zeros(1, dtype=torch.int32, device=dev)
    start, limit = spec.pad if spec.pad is not None else (dummy, dummy)
    ids = spec.ids if spec.ids is not None else dummy
    return [start, limit, ids, lists.bits]


def _score_args(p: Problem, param: Tensor | None) -> tuple[list[Any], list[Any], float, int]:
    """``(tensors, strides, cap, R)``: BIAS, SLOPES, TABLE and their strides."""
    dev = p.device
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    bias, slopes, table = dummy, dummy, dummy
    sb = [0, 0, 0, 0]
    st = [0, 0]
    cap, R = 1.0, 0
    kind = p.score.kind
    mod: Any = p.score.score_mod
    if kind == "bias":
        assert param is not None
        bias = param
        sb = _broadcast_strides(bias)
    elif kind == "alibi":
        assert param is not None
        slopes = param
    elif kind == "softcap":
        cap = float(mod.cap)
    elif kind == "relative":
        assert param is not None
        table = param
        st = [table.stride(0), table.stride(1)]
        R = int(mod.max_distance)
    return [bias, slopes, table], [*sb, *st], cap, R


def _broadcast_strides(t: Tensor) -> list[int]:
    """A 4-D tensor's strides, 0 along the dimensions it broadcasts over (size 1)."""
    return [t.stride(i) if t.shape[i] > 1 else 0 for i in range(4)]


def score_param(p: Problem) -> Tensor | None:
    """The tensor the score reads: an additive bias ``[B|1, Hq|1, Lq|1, Lk|1]`` as given, or
    a built-in score mod's (ALiBi slopes ``[Hq]``, the relative table ``[2R+1, Hq]``) on the
    problem's device as float32 and contiguous; autograd links kept. ``None`` otherwise."""
    mod: Any = p.score.score_mod
    if p.score.kind == "bias":
        return p.score.bias
    if p.score.kind == "alibi":
        t = mod.slopes
    elif p.score.kind == "relative":
        t = mod.table
    else:
        return None
    return t.to(device=p.device, dtype=torch.float32).contiguous()


def _common(p: Problem, spec: MaskSpec, lists: TileLists, tiling: Tiling) -> dict[str, Any]:
    return {
        "D": p.D,
        "BLOCK_D": _pow2(p.D),
        "BLOCK_DV": _pow2(p.Dv),
        "BM": tiling.bq,
        "BN": tiling.bk,
        "SCORE": SCORE_CODES[p.score.kind],
        "MMA": _mma_dtype(p.dtype),
        "num_warps": tiling.warps,
        "num_stages": tiling.stages,
        **spec.flags(),
    }


def _mma_dtype(dtype: torch.dtype) -> Any:
    """The dtype matrix products take their operands in: the inputs' own, except bfloat16 in
    the interpreter, whose bfloat16 dot is wrong (numpy has no bfloat16). Products of two
    bfloat16 values are exact in float32, so the float32 product is what a tensor core
    computes."""
    import triton.language as tl

    if dtype == torch.bfloat16 and interpreted():
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(dtype, tl.float32)


def _lo_hi_prefix(spec: MaskSpec) -> tuple[int, int, int]:
    lo, hi = spec.band if spec.band is not None else (0, 0)
    return lo, hi, spec.prefix if spec.prefix is not None else 0


def _list_strides(lists: TileLists, n: int) -> tuple[int, int]:
    bm, hm = lists.broadcast
    return (hm * n if bm > 1 else 0), (n if hm > 1 else 0)


def forward(
    call: Call,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    param: Tensor | None,
    *,
    out_dtype: torch.dtype,
    pv_f32: bool = False,
) -> tuple[Tensor, Tensor]:
    """``out [B, Hq, Lq, Dv]`` in ``out_dtype`` and ``lse [B, Hq, Lq]`` float32. ``pv_f32``
    multiplies the probabilities by V in float32 instead of rounding them to V's dtype."""
    from . import kernels

    p, spec, lists, t = call.p, call.spec, call.fwd, call.tiles.fwd
    B, Hq, Lq, Lk = p.shape
    out = torch.empty(B, Hq, Lq, p.Dv, dtype=out_dtype, device=q.device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    nq = lists.kv_num.shape[-1]
    lb, lh = _list_strides(lists, nq)
    tensors, strides, cap, R = _score_args(p, param)
    lo, hi, prefix = _lo_hi_prefix(spec)
    kernels.attn_fwd[(nq, B * Hq)](
        q, k, v, out, lse,
        lists.kv_num, lists.kv_idx, lists.kv_tag,
        *_mask_args(p, spec, lists), *tensors,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *strides,
        Hq, p.groups, Lq, Lk, lists.kv_idx.shape[-1], lb, lh, nq,
        p.scale, lo, hi, prefix, cap, R,
        DV=p.Dv,
        PV_F32=pv_f32,
        **_common(p, spec, lists, t),
    )  # fmt: skip
    return out, lse


def backward(
    call: Call,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    param: Tensor | None,
    param_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dparam)``, float32 (the caller casts)."""
    from . import kernels

    p, spec, t = call.p, call.spec, call.tiles.bwd
    lists: TileLists = call.bwd_lists()
    B, Hq, Lq, Lk = p.shape
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)  # [B, Hq, Lq]
    if dlse is not None:  # d lse / d s = P: it enters as delta - dlse
        delta = delta - dlse.float()
    delta = delta.contiguous()
    dq = torch.empty(B, Hq, Lq, p.D, dtype=torch.float32, device=q.device)
    dk = torch.empty(B, p.Hkv, Lk, p.D, dtype=torch.float32, device=q.device)
    dv = torch.empty(B, p.Hkv, Lk, p.Dv, dtype=torch.float32, device=q.device)
    dparam = None
    if param_grad and param is not None:
        dparam = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    tensors, strides, cap, R = _score_args(p, param)
    lo, hi, prefix = _lo_hi_prefix(spec)
    masks = _mask_args(p, spec, lists)
    common = _common(p, spec, lists, t)
    nq, nk = lists.kv_num.shape[-1], lists.q_num.shape[-1]
    qkv_strides = [
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
    ]  # fmt: skip
    lb, lh = _list_strides(lists, nk)
    kernels.attn_bwd_dkdv[(nk, B * p.Hkv)](
        q, k, v, dout, lse, delta, dk, dv,
        lists.q_num, lists.q_idx, lists.q_tag, *masks, *tensors,
        *qkv_strides, *strides,
        Hq, p.Hkv, p.groups, Lq, Lk, lists.q_idx.shape[-1], lb, lh, nk,
        p.scale, lo, hi, prefix, cap, R,
        DV_=p.Dv,
        **common,
    )  # fmt: skip
    dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
    lb, lh = _list_strides(lists, nq)
    kernels.attn_bwd_dq[(nq, B * Hq)](
        q, k, v, dout, lse, delta, dq,
        dparam if dparam is not None else dummy,
        lists.kv_num, lists.kv_idx, lists.kv_tag, *masks, *tensors,
        *qkv_strides, *strides,
        *(_broadcast_strides(dparam) if dparam is not None and dparam.ndim == 4 else [0] * 4),
        Hq, p.groups, Lq, Lk, lists.kv_idx.shape[-1], lb, lh, nq,
        p.scale, lo, hi, prefix, cap, R,
        DV_=p.Dv,
        PARAM_GRAD=dparam is not None,
        **common,
    )  # fmt: skip
    return dq, dk, dv, dparam


class TritonAttention(torch.autograd.Function):
    """Forward and backward of one call on the Triton kernels."""

    @staticmethod
    def forward(
        ctx: Any, call: Call, q: Tensor, k: Tensor, v: Tensor, param: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        # The backward's delta = rowsum(dO * O) needs O before rounding: from bfloat16 O
        # its error reaches a summed gradient (a relative-position table's) at 3x plain
        # PyTorch's (measured in the oracle matrix), so the kernel writes float32 and the
        # rounded copy is returned.
        # A score tensor's gradient sums dS * (its derivative) over whole rows, where delta's
        # error from probabilities rounded to bfloat16 no longer averages out (ALiBi slopes:
        # 4.6x plain PyTorch's error, measured): then P @ V runs in float32 too.
        pv_f32 = param is not None and param.requires_grad and q.dtype != torch.float32
        out32, lse = forward(call, q, k, v, param, out_dtype=torch.float32, pv_f32=pv_f32)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out32, lse, param)
        return out32.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
        q, k, v, out32, lse, param = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out32, dtype=q.dtype)
        need_param = bool(ctx.needs_input_grad[4])
        dq, dk, dv, dparam = backward(ctx.call, q, k, v, out32, lse, dout, dlse, param, need_param)
        return (
            None,
            dq.to(q.dtype) if ctx.needs_input_grad[1] else None,
            dk.to(k.dtype) if ctx.needs_input_grad[2] else None,
            dv.to(v.dtype) if ctx.needs_input_grad[3] else None,
            dparam.to(param.dtype) if need_param and dparam is not None else None,
        )

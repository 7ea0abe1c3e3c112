"""Launching the Triton kernels: tilings, argument packing, and the autograd Function.

Three layers (STYLE.md rule 7): :class:`qkv.backends.triton.TritonBackend` → :class:`TritonAttention`
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
        return Tilings(fwd=Tiling(16, 32, 1, 1), bwd=Tiling(16, 32, 1, 1))
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
        assert p.score.bias is not None
        bias = p.score.bias
        sb = [bias.stride(i) if bias.shape[i] > 1 else 0 for i in range(4)]
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


def score_param(p: Problem) -> Tensor | None:
    """The tensor a built-in score mod reads (ALiBi slopes [Hq], the relative table
    [2R+1, Hq]) on the problem's device as float32 and contiguous, keeping its autograd
    link, or ``None``."""
    mod: Any = p.score.score_mod
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
        "UPCAST": interpreted() and p.dtype == torch.bfloat16,
        "num_warps": tiling.warps,
        "num_stages": tiling.stages,
        **spec.flags(),
    }


def _lo_hi_prefix(spec: MaskSpec) -> tuple[int, int, int]:
    lo, hi = spec.band if spec.band is not None else (0, 0)
    return lo, hi, spec.prefix if spec.prefix is not None else 0


def _list_strides(lists: TileLists, n: int) -> tuple[int, int]:
    bm, hm = lists.broadcast
    return (hm * n if bm > 1 else 0), (n if hm > 1 else 0)


def forward(call: Call, q: Tensor, k: Tensor, v: Tensor, param: Tensor | None) -> tuple[Tensor, Tensor]:
    """``out [B, Hq, Lq, Dv]`` (q's dtype) and ``lse [B, Hq, Lq]`` float32."""
    from . import kernels

    p, spec, lists, t = call.p, call.spec, call.fwd, call.tiles.fwd
    B, Hq, Lq, Lk = p.shape
    out = torch.empty(B, Hq, Lq, p.Dv, dtype=q.dtype, device=q.device)
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
    dparam = torch.zeros_like(param, dtype=torch.float32) if param_grad and param is not None else None
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
        dparam if (dparam is not None and p.score.kind == "alibi") else dummy,
        dparam if (dparam is not None and p.score.kind == "relative") else dummy,
        lists.kv_num, lists.kv_idx, lists.kv_tag, *masks, *tensors,
        *qkv_strides, *strides,
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
    def forward(  # type: ignore[override]
        ctx: Any, call: Call, q: Tensor, k: Tensor, v: Tensor, param: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        out, lse = forward(call, q, k, v, param)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, lse, param)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
        q, k, v, out, lse, param = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        need_param = bool(ctx.needs_input_grad[4])
        dq, dk, dv, dparam = backward(ctx.call, q, k, v, out, lse, dout, dlse, param, need_param)
        return (
            None,
            dq.to(q.dtype) if ctx.needs_input_grad[1] else None,
            dk.to(k.dtype) if ctx.needs_input_grad[2] else None,
            dv.to(v.dtype) if ctx.needs_input_grad[3] else None,
            dparam if need_param else None,
        )

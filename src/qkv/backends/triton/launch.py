"""Launching the Triton kernels: tilings, argument packing, and the autograd Function.

Three layers: :class:`qkv.backends.triton.TritonBackend` →
:class:`TritonAttention`
(this file) → the kernels (``kernels/``: forward.py, backward.py, parts.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..._core.builtin_scores import BuiltinScore, ScoreTerms
from ..._core.kinds import ScoreKind
from ..._core.problem import Problem
from ..base import Recipe
from .lists import MaskSpec, TileLists

Tensor = torch.Tensor


def score_terms(s: ScoreKind) -> ScoreTerms | None:
    """The score's formula as the kernel knows it (:class:`ScoreTerms`), ``None`` for none or
    a bias (a user's score_mod is rejected before: it has no terms)."""
    mod = s.score_mod
    return mod.terms() if isinstance(mod, BuiltinScore) else None


def score_code(s: ScoreKind) -> int:
    """The kernel's SCORE constexpr: 0 none, 1 bias, 2 slopes (ALiBi), 3 cap, 4 table."""
    if s.bias is not None:
        return 1
    t = score_terms(s)
    if t is None:
        return 0
    return 2 if t.slopes is not None else 3 if t.cap is not None else 4


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
    dkdv: Tiling  # the dK/dV kernel: bq query rows a step, bk keys a program
    dq: Tiling  # the dQ kernel: bq query rows a program, bk keys a step

    def sizes(self) -> list[tuple[int, int]]:
        return list(dict.fromkeys((t.bq, t.bk) for t in (self.fwd, self.dkdv, self.dq)))


def interpreted() -> bool:
    """True when the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they
    were first imported; read from the environment until then)."""
    import sys

    mod = sys.modules.get(__name__.rsplit(".", 1)[0] + ".kernels")
    if mod is not None:
        return bool(getattr(mod, "INTERPRETED", False))
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tilings(p: Problem, spec: MaskSpec) -> Tilings:
    """The tiles for a problem: :func:`gpu_tilings`, or in the interpreter (whose cost is per
    tile operation) small tiles that put several blocks in short test sequences and large
    ones for long sequences."""
    if interpreted():
        t = Tiling(16, 32, 1, 1) if p.Lq * p.Lk <= 1 << 12 else Tiling(128, 128, 1, 1)
        return Tilings(fwd=t, dkdv=t, dq=t)
    return gpu_tilings(max(p.D, p.Dv), p.dtype, heavy(p, spec))


def gpu_tilings(d: int, dtype: torch.dtype = torch.bfloat16, heavy: bool = False) -> Tilings:
    """Tiles by head dim ``d`` and dtype for sm_90: the largest of FlashAttention-2's and
    Triton's tutorial choices that ptxas compiles with wgmma and without register spills,
    checked without a GPU (``python -m qkv.backends.triton.ahead``; the table is in
    benchmarks/RESULTS.md). ``heavy`` (a score mod, or mask terms beyond a band or prefix)
    takes 32-key forward steps: with 64 the extra registers spill. float32 has no tensor-core
    path here (exact float32 products, ``input_precision="ieee"``): small tiles. Not yet timed
    on a GPU."""
    if dtype == torch.float32:
        return Tilings(fwd=Tiling(32, 32, 4, 2), dkdv=Tiling(16, 32, 4, 1), dq=Tiling(32, 32, 4, 1))
    if d <= 128:
        fwd = Tiling(128, 32, 8, 3) if heavy else Tiling(128, 64, 8, 3)
        if d <= 64:
            return Tilings(fwd=fwd, dkdv=Tiling(32, 128, 8, 2), dq=Tiling(128, 64, 8, 2))
        dq = Tiling(128, 32, 8, 2) if heavy else Tiling(128, 64, 8, 3)
        return Tilings(fwd=fwd, dkdv=Tiling(32, 64, 8, 2), dq=dq)
    return Tilings(fwd=Tiling(64, 32, 8, 2), dkdv=Tiling(32, 32, 8, 1), dq=Tiling(64, 32, 8, 1))


def heavy(p: Problem, spec: MaskSpec) -> bool:
    """A score mod, or mask terms beyond a band and a prefix (more live registers a tile)."""
    return not p.score.is_none or spec.pad is not None or spec.ids is not None or spec.bits


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, (n - 1).bit_length()))


@dataclass(frozen=True, eq=False)
class Call(Recipe):
    """Everything one call's kernels read besides q, k, v and the score tensors. A plan keeps
    it without its problem (``p`` ``None``); ``run`` binds each call's."""

    p: Problem | None
    spec: MaskSpec
    lists: Any  # (bq, bk) -> TileLists at that tiling (built on first use, then cached)
    tiles: Tilings
    # weak reference to the problem whose mask values the lists were made from, when a
    # signature does not watch them (qkv._core.kindspec.unwatched); None: they serve every call
    planned: Any = None


@functools.cache
def _placeholder(dtype: torch.dtype, device: torch.device) -> Tensor:
    """A one-element tensor for pointer arguments a kernel specialisation never reads (made
    once per device: no allocation and fill kernel on every call)."""
    return torch.zeros(1, dtype=dtype, device=device)


def _mask_args(p: Problem, spec: MaskSpec, lists: TileLists) -> list[Any]:
    dev = p.device
    dummy = _placeholder(torch.int32, dev)
    start, limit = spec.pad if spec.pad is not None else (dummy, dummy)
    ids = spec.ids if spec.ids is not None else dummy
    return [start, limit, ids, spec.ids_stride, lists.bits]


def _score_args(p: Problem, param: Tensor | None) -> tuple[list[Any], list[Any], float, int]:
    """``(tensors, strides, cap, R)``: BIAS, SLOPES, TABLE and their strides."""
    dev = p.device
    dummy = _placeholder(torch.float32, dev)
    bias, slopes, table = dummy, dummy, dummy
    sb = [0, 0, 0, 0]
    st = [0, 0]
    cap, R = 1.0, 0
    t = score_terms(p.score)
    if p.score.bias is not None:
        assert param is not None
        bias = param
        sb = _broadcast_strides(bias)
    elif t is None:
        pass
    elif t.slopes is not None:
        assert param is not None
        slopes = param
    elif t.cap is not None:
        cap = float(t.cap)
    elif t.table is not None:
        assert param is not None
        table = param
        st = [table.stride(0), table.stride(1)]
        R = int(t.max_distance)
    return [bias, slopes, table], [*sb, *st], cap, R


def _broadcast_strides(t: Tensor) -> list[int]:
    """A 4-D tensor's strides, 0 along the dimensions it broadcasts over (size 1)."""
    return [t.stride(i) if t.shape[i] > 1 else 0 for i in range(4)]


def score_param(p: Problem) -> Tensor | None:
    """The tensor the score reads: an additive bias ``[B|1, Hq|1, Lq|1, Lk|1]`` as given, or
    a built-in score mod's (ALiBi slopes ``[Hq]``, the relative table ``[2R+1, Hq]``) on the
    problem's device as float32 and contiguous; autograd links kept. ``None`` otherwise."""
    if p.score.bias is not None:
        return p.score.bias
    terms = score_terms(p.score)
    t = None if terms is None else terms.tensor
    if t is None:
        return None
    return t.to(device=p.device, dtype=torch.float32).contiguous()


def constexprs(p: Problem, spec: MaskSpec, tiling: Tiling, *, interp: bool) -> dict[str, Any]:
    """The compile-time arguments every kernel takes (and the launch's warps and stages)."""
    return {
        "D": p.D,
        "BLOCK_D": _pow2(p.D),
        "BLOCK_DV": _pow2(p.Dv),
        "BM": tiling.bq,
        "BN": tiling.bk,
        "SCORE": score_code(p.score),
        "MMA": _mma_dtype(p.dtype, interp),
        "num_warps": tiling.warps,
        "num_stages": tiling.stages,
        **spec.flags(),
    }


def _mma_dtype(dtype: torch.dtype, interp: bool) -> Any:
    """The dtype matrix products take their operands in: the inputs' own, except bfloat16 in
    the interpreter, whose bfloat16 dot is wrong (numpy has no bfloat16). Products of two
    bfloat16 values are exact in float32, so the float32 product is what a tensor core
    computes."""
    import triton.language as tl

    if dtype == torch.bfloat16 and interp:
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

    p, spec, t = call.p, call.spec, call.tiles.fwd
    assert p is not None, "a kept call runs bound to its problem"
    lists: TileLists = call.lists((t.bq, t.bk))
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
        **constexprs(p, spec, t, interp=interpreted()),
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

    p, spec, tiles = call.p, call.spec, call.tiles
    assert p is not None, "a kept call runs bound to its problem"
    by_key: TileLists = call.lists((tiles.dkdv.bq, tiles.dkdv.bk))  # its q lists
    by_query: TileLists = call.lists((tiles.dq.bq, tiles.dq.bk))  # its kv lists
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
    interp = interpreted()
    nq, nk = by_query.kv_num.shape[-1], by_key.q_num.shape[-1]
    qkv_strides = [
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
    ]  # fmt: skip
    lb, lh = _list_strides(by_key, nk)
    kernels.attn_bwd_dkdv[(nk, B * p.Hkv)](
        q, k, v, dout, lse, delta, dk, dv,
        by_key.q_num, by_key.q_idx, by_key.q_tag, *_mask_args(p, spec, by_key), *tensors,
        *qkv_strides, *strides,
        Hq, p.Hkv, p.groups, Lq, Lk, by_key.q_idx.shape[-1], lb, lh, nk,
        p.scale, lo, hi, prefix, cap, R,
        DV_=p.Dv,
        **constexprs(p, spec, tiles.dkdv, interp=interp),
    )  # fmt: skip
    dummy = _placeholder(torch.float32, q.device)
    lb, lh = _list_strides(by_query, nq)
    kernels.attn_bwd_dq[(nq, B * Hq)](
        q, k, v, dout, lse, delta, dq,
        dparam if dparam is not None else dummy,
        by_query.kv_num, by_query.kv_idx, by_query.kv_tag, *_mask_args(p, spec, by_query),
        *tensors, *qkv_strides, *strides,
        *(_broadcast_strides(dparam) if dparam is not None and dparam.ndim == 4 else [0] * 4),
        Hq, p.groups, Lq, Lk, by_query.kv_idx.shape[-1], lb, lh, nq,
        p.scale, lo, hi, prefix, cap, R,
        DV_=p.Dv,
        PARAM_GRAD=dparam is not None,
        **constexprs(p, spec, tiles.dq, interp=interp),
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

"""The block-sparse engine under ``torch.compile``: one graph, through the engine's operators.

Planning a block-sparse call reads tensor values (which tiles a document mask or padding
lengths leave empty), which dynamo cannot trace without breaking the graph. While it traces,
a call whose mask and score are built-ins (each class writes its spec, :mod:`qkv._core.spec`)
goes through ``qkv::blocksparse`` (:mod:`.operators`, the operators eager calls run too),
which plans its tiles when the graph runs. A user's mask_mod is evaluated in the graph into a
bool tensor the operator takes; a user's score_mod cannot cross an operator (it is code, not
a tensor): such calls keep the plain formula in the graph, or the engine eagerly behind a
graph break. A window without a score calls the compiled band kernel through its own
operators (``qkv::band``, ``qkv::band_backward``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..._core.evaluate import mask_at, whole
from ..._core.kinds import classify_mask
from ..._core.kindspec import mask_spec, score_spec
from ..._core.problem import Problem
from ..._core.spec import has_numbers
from ..._core.tracing import assume_constant_result, is_symbolic
from . import native
from .grads import huge_lse, lse_hi_lo
from .operators import attention_backward
from .plan import make_job, native_band_shape

Tensor = torch.Tensor

__all__ = ["attention", "why_not"]


# A user's mask_mod (code) is evaluated in the graph into a bool tensor the operator takes,
# for problems of up to this many scores (one byte each at most: 256 MiB); beyond, eagerly.
DENSE_MASK_SCORES = 1 << 28


def why_not(p: Problem) -> str | None:
    """Why a call cannot run as the operators (None if it can)."""
    if p.dropout_p > 0:
        return "dropout draws random numbers per call (eager only)"
    if p.B * p.Hq * p.Lq == 0 or p.Lk == 0:
        return "an empty problem"
    if mask_spec(p.mask, []) is None and p.B * p.Hq * p.Lq * p.Lk > DENSE_MASK_SCORES:
        return (
            f"the mask {p.mask.name} holds a user's mask_mod (code, not tensors), and a dense "
            f"bool mask of it would pass {DENSE_MASK_SCORES} scores"
        )
    if score_spec(p.score, []) is None:
        return f"the score_mod {p.score.name} is a user's (code, not tensors)"
    return None


def attention(p: Problem) -> tuple[Tensor, Tensor | None]:
    """``out [B, Hq, Lq, Dv]`` and ``lse [B, Hq, Lq]`` (compute dtype; ``None`` when ``p``
    does not return it and the band kernel ran) of ``p`` through the operators
    (:func:`why_not` said it can)."""
    mt: list[Tensor] = []
    st: list[Tensor] = []
    ms, ss = mask_spec(p.mask, mt), score_spec(p.score, st)
    if (
        ms is not None
        and ss == "none"
        and not p.return_lse
        and not (has_numbers(ms) or is_symbolic(p.scale))  # (dynamic=True: the operators)
        and _band_kernel(p)
    ):
        out, _ = torch.ops.qkv.band(p.q, p.k, p.v, p.mask.lo, p.mask.hi, p.scale, ms)
        return out, None
    if ms is None:  # a user's mask_mod: evaluated here, in the graph, into a bool tensor
        mt = []
        dense = mask_at(p.mask, *whole(p.shape), p.device)
        assert dense is not None
        ms = mask_spec(classify_mask(dense), mt)
    assert ms is not None and ss is not None
    out, lse = torch.ops.qkv.blocksparse(p.q, p.k, p.v, ms, mt, ss, st, p.scale, p.return_lse)
    return out, lse.to(p.compute_dtype)


def _band_kernel(p: Problem) -> bool:
    """Whether the engine would run ``p`` (a window, no score) on qkv's compiled band kernel:
    then the graph calls the kernel's own operators (``qkv::band``), without the Python of
    the ``qkv::blocksparse`` operators, which cost ~0.2-0.4 ms a call beside a kernel of
    ~10 ms (benchmarks/RESULTS.md). What the kernel cannot take (another dtype, too wide a
    band) is answered before any planning: planning a torch route reads the tile plan's
    values, which dynamo cannot trace (bfloat16 under autocast failed so)."""
    if not p.mask.is_band or p.mask.is_causal or p.device.type != "cpu":
        return False
    if native_band_shape(p) is not None or not _band_kernel_loaded():
        return False
    return make_job(p, dry_run=True).route == "native_band"


@assume_constant_result
def _band_kernel_loaded() -> bool:
    """Whether qkv's band kernel can be had, loading it (building it on first use) if need
    be. Run eagerly while dynamo traces, which cannot load a library; its answer is taken as
    a constant, not guarded (a graph traced before the kernel loaded keeps the operator)."""
    return native.band_forward_op() is not None


@torch.library.custom_op("qkv::band", mutates_args=())
def _band(
    q: Tensor, k: Tensor, v: Tensor, lo: int, hi: int, scale: float, ms: str
) -> tuple[Tensor, Tensor]:
    """A window through qkv's compiled band kernel, traced into a graph: ``out [B, Hq, Lq,
    Dv]`` and ``lse [B, Hq, Lq]`` (float64, what the backward takes). An operator with its
    autograd registered, not an autograd Function: dynamo refuses a Function given the same
    tensor twice (``qkv.attention(x, x, x)``), an operator takes any inputs."""
    out, lse = native.band_forward(q, k, v, lo, hi, scale)
    return out, lse.double()


@_band.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    B, Hq, Lq, _ = q.shape
    return q.new_empty(B, Hq, Lq, v.shape[3]), q.new_empty(B, Hq, Lq, dtype=torch.float64)


def _band_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, lo, hi, scale, ms = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.meta = (lo, hi, scale, ms)


def _band_grad(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Any, ...]:
    # (dlse: the lse is internal, qkv.attention returns it only on the operators' route)
    q, k, v, out, lse = ctx.saved_tensors
    lo, hi, scale, ms = ctx.meta
    dq, dk, dv = torch.ops.qkv.band_backward(q, k, v, out, lse, dout, lo, hi, scale, ms)
    return dq, dk, dv, None, None, None, None


_band.register_autograd(_band_grad, setup_context=_band_setup)


# Why an operator and not ``torch.cond`` on the lse: a ``torch.cond``'s branches may not take
# inputs that alias each other, and q, k, v are exactly that in most models (views of one
# fused projection, nanoGPT's ``c_attn(x).split(...)``; or one tensor passed three times):
# tracing the backward failed with "cond_true might be aliasing the input or the output!".
# An operator takes any inputs; the choice between the two backwards is made when it runs.
@torch.library.custom_op("qkv::band_backward", mutates_args=())
def _band_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    lo: int,
    hi: int,
    scale: float,
    ms: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` (contiguous) of ``qkv::band``'s window. Where a row's lse passes
    ``HUGE_LOGIT`` (``qkv.backends.base``) the kernel's backward, which recomputes the scores
    in another order, would lose digits: such a call takes ``qkv::blocksparse_backward``
    instead, which redoes the call with explicit matmuls, as eager does."""
    if huge_lse(lse):
        g = attention_backward(
            q, k, v, out, lse, dout, None, ms, [], "none", [], scale, [True, True, True]
        )
        return g[0], g[1], g[2]
    lse_hi, lse_lo = lse_hi_lo(lse, torch.float32)
    return native.band_backward(q, k, v, out, dout, lse_hi, lse_lo, None, lo, hi, scale)


@_band_backward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

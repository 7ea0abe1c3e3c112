"""The block-sparse engine as two custom operators, so ``torch.compile`` keeps it in one graph.

Planning a block-sparse call reads tensor values (which tiles a document mask or padding
lengths leave empty), which dynamo cannot trace without breaking the graph. While it traces,
a call whose mask and score are built-ins (:mod:`qkv._core.kindspec`) goes through
``qkv::blocksparse`` and ``qkv::blocksparse_backward`` instead: operators that take the
tensors and the kinds' specs, plan and run the engine inside (as eager does), and have fake
implementations that give only the output shapes. Autograd is registered on the forward
operator: gradients reach q, k, v and the tensors a score carries (a bias, ALiBi slopes, a
relative-bias table). A user's mask_mod or score_mod cannot cross an operator (it is code,
not a tensor): such calls keep the engine's eager path, with graph breaks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..._core.evaluate import mask_at, whole
from ..._core.kinds import MaskKind, ScoreKind, classify_mask
from ..._core.kindspec import mask_from_spec, mask_spec, score_from_spec, score_spec
from ..._core.lru import LRU
from ..._core.problem import Problem
from ..._core.spec import has_numbers, holds_tensors
from ..._core.tracing import assume_constant_result, is_symbolic
from ..._planning.signature import native_setting
from ..base import HUGE_LOGIT, unit_last_stride
from . import native
from .autograd import captured
from .backward import backward
from .forward import forward
from .grads import huge_lse, lse_hi_lo
from .job import Job
from .plan import make_job

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
        return _Band.apply(p.q, p.k, p.v, p.mask.lo, p.mask.hi, p.scale, ms), None
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
    then the graph calls the kernel's own operators directly (:class:`_Band`), without the
    Python of the ``qkv::blocksparse`` operators, which cost ~0.2-0.4 ms a call beside a
    kernel of ~10 ms (benchmarks/RESULTS.md)."""
    if (
        not p.mask.is_band
        or p.mask.is_causal
        or p.device.type != "cpu"
        or not _band_kernel_loaded()
    ):
        return False
    return make_job(p, dry_run=True).route == "native_band"


@assume_constant_result
def _band_kernel_loaded() -> bool:
    """Whether qkv's band kernel can be had, loading it (building it on first use) if need
    be. Run eagerly while dynamo traces, which cannot load a library; its answer is taken as
    a constant, not guarded (a graph traced before the kernel loaded keeps the operator)."""
    return native.band_forward_op() is not None


class _Band(torch.autograd.Function):
    """A window through qkv's compiled band kernel, traced into the graph: the kernel's own C++
    operators (``qkv_native::band_forward`` / ``band_backward``). Where a row's lse passes
    :data:`HUGE_LOGIT` the kernel's backward, which recomputes the scores in another order,
    would lose digits: there a ``torch.cond`` takes ``qkv::blocksparse_backward`` instead,
    which redoes the call with explicit matmuls, as eager does."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, lo: int, hi: int, scale: float, ms: str
    ) -> Tensor:
        out, lse = native.band_forward(q, k, v, lo, hi, scale)
        lse = lse.double()  # (what the engine's backward takes)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (lo, hi, scale, ms)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        lo, hi, scale, ms = ctx.meta

        def engine(
            q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor
        ) -> tuple[Tensor, Tensor, Tensor]:
            g = torch.ops.qkv.blocksparse_backward(
                q, k, v, out, lse, dout, None, ms, [], "none", [], scale, [True, True, True]
            )
            # (contiguous, as the kernel's: torch.cond's branches must agree on strides)
            return g[0], g[1], g[2]

        def kernel(
            q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor
        ) -> tuple[Tensor, Tensor, Tensor]:
            lse_hi, lse_lo = lse_hi_lo(lse, torch.float32)
            return native.band_backward(q, k, v, out, dout, lse_hi, lse_lo, None, lo, hi, scale)

        finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        huge = (finite.abs() > HUGE_LOGIT).any()
        dq, dk, dv = torch.cond(huge, engine, kernel, (q, k, v, out, lse, dout))
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                None, None, None, None)  # fmt: skip


def _problem(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ms: str,
    mt: list[Tensor],
    ss: str,
    st: list[Tensor],
    scale: float,
) -> Problem:
    return Problem(
        q=q,
        k=k,
        v=v,
        mask=_kind(ms, mt, _MASKS, mask_from_spec),
        score=_kind(ss, st, _SCORES, score_from_spec),
        scale=scale,
        dropout_p=0.0,
        return_lse=True,
        orig_ndim=4,
    )


# The kinds of specs without tensors (a window's, a softcap's), parsed once: the operators
# rebuild their problem at every call of a compiled graph, forward and backward.
_MASKS: LRU[str, MaskKind] = LRU(256)
_SCORES: LRU[str, ScoreKind] = LRU(256)


def _kind(spec: str, tensors: list[Tensor], kept: LRU[str, Any], parse: Any) -> Any:
    """``parse(spec, tensors)``, kept in ``kept`` when the spec holds no tensor."""
    if tensors:
        return parse(spec, tensors)
    kind = kept.get(spec)
    if kind is None:
        kind = parse(spec, tensors)
        kept.put(spec, kind)
    return kind


# Jobs of masks whose spec holds their whole structure (no mask tensors: no mask, causal,
# windows, prefix-LM), kept by what planning reads: the compiled graph's forward and backward
# operators then plan once per shape, not at every call (the eager path keeps its plans under
# the call's signature). Bounded; a graph has few shapes.
_JOBS: LRU[tuple[object, ...], Job] = LRU(64)


def _job(p: Problem, ms: str, ss: str) -> Job:
    """``make_job(p)``, kept for masks without tensors (see ``_JOBS``); ``ms`` and ``ss`` are
    ``p``'s specs. The key is what planning reads, the specs standing for the kinds (their
    tensors' values are read from the bound problem at every call)."""
    if has_numbers(ms) or has_numbers(ss):  # the ints the specs left in slots, written out
        ms, ss = mask_spec(p.mask, []) or "", score_spec(p.score, []) or ""
    if holds_tensors(ms) or holds_tensors(ss):
        return make_job(p)
    q, k, v = p.q, p.k, p.v
    key = (ms, ss, q.shape, k.shape, v.shape, q.dtype, q.device, p.scale, q.requires_grad,
           k.requires_grad, v.requires_grad, torch.is_grad_enabled(), native_setting())  # fmt: skip
    job = _JOBS.get(key)
    if job is not None:
        return job.for_run(call=p)
    job = make_job(p)
    if not job.replan:
        _JOBS.put(key, job.unbound())
    return job


@torch.library.custom_op("qkv::blocksparse", mutates_args=())
def _forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_spec: str,
    mask_tensors: list[Tensor],
    score_spec: str,
    score_tensors: list[Tensor],
    scale: float,
    lse_grad: bool,
) -> tuple[Tensor, Tensor]:
    """``(out [B, Hq, Lq, Dv] in q's dtype, lse [B, Hq, Lq] float64)``; ``lse_grad``: whether
    a gradient may flow back through ``lse`` (the caller returns it)."""
    p = _problem(q, k, v, mask_spec, mask_tensors, score_spec, score_tensors, scale)
    job = _job(p, mask_spec, score_spec)
    with torch.no_grad():
        out, lse = forward(job, *_dense_last(job.fused, q, k, v))
    # contiguous, as the fake implementation says (a causal call's kernel writes [B, L, H, D])
    return out.contiguous(), lse.contiguous()


@_forward_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    B, Hq, Lq, _ = q.shape
    return q.new_empty(B, Hq, Lq, v.shape[3]), q.new_empty(B, Hq, Lq, dtype=torch.float64)


@torch.library.custom_op("qkv::blocksparse_backward", mutates_args=())
def _backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    mask_spec: str,
    mask_tensors: list[Tensor],
    score_spec: str,
    score_tensors: list[Tensor],
    scale: float,
    need: list[bool],
) -> list[Tensor]:
    """``[dq, dk, dv, *d(score_tensors)]`` in the inputs' dtypes; an empty tensor where
    ``need`` (q, k, v, then each score tensor) says no gradient is wanted."""
    with _autograd_inside():  # a score's tensors are differentiated by re-running it
        leaves = [
            t.detach().requires_grad_(n) for t, n in zip(score_tensors, need[3:], strict=True)
        ]
        p = _problem(q, k, v, mask_spec, mask_tensors, score_spec, leaves, scale)
        job = _job(p, mask_spec, score_spec)
        if job.fused and huge_lse(lse):
            # As eager does (BlocksparseBackend.run): rows beyond what the fused kernel's
            # recomputed scores keep exact are redone with explicit matmuls.
            job = make_job(p, matmul=True)
            with torch.no_grad():
                out, lse = forward(job, q, k, v)
        params = tuple(captured(job.score_mod)) if job.score_mod is not None else ()
        job = job.for_run(params=params)
        bias_need = p.score.bias is not None and p.score.bias.requires_grad
        need_all = [*need[:3], bias_need, *(t.requires_grad for t in params)]
        qq, kk, vv = _dense_last(job.fused, q, k, v)
        # Autograd hands the operator zeros where nothing flowed into a returned lse: the
        # engine's backward then skips that term, as in eager.
        d_lse = dlse if dlse is not None and bool(dlse.any()) else None
        g = backward(job, qq, kk, vv, out, lse, dout, d_lse, need_all)
    by_id = {id(t): d for t, d in zip(params, g.dparams, strict=True)}
    # Contiguous, as the fake implementation says: the compiled backward views them by the
    # fake's strides (MultiHeadAttention's transposes back to [B, L, H*D] failed otherwise).
    grads = [
        g.dq.to(q.dtype).contiguous() if need[0] else q.new_empty(0),
        g.dk.to(k.dtype).contiguous() if need[1] else k.new_empty(0),
        g.dv.to(v.dtype).contiguous() if need[2] else v.new_empty(0),
    ]
    for t, leaf, n in zip(score_tensors, leaves, need[3:], strict=True):
        d = g.dbias if leaf is p.score.bias else by_id.get(id(leaf))
        if not n:
            grads.append(t.new_empty(0))
        else:  # a tensor no visible score reached gets zeros, as plain autograd gives
            d = torch.zeros(t.shape, dtype=t.dtype, device=t.device) if d is None else d
            grads.append(d.to(t.dtype).contiguous())
    return grads


@_backward_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> list[Tensor]:
    score_tensors, need = args[-3], args[-1]
    return [
        t.new_empty(t.shape) if n else t.new_empty(0)  # contiguous, as the operator's are
        for t, n in zip([q, k, v, *score_tensors], need, strict=True)
    ]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, ms, mt, ss, st, scale, lse_grad = inputs
    if not lse_grad:  # lse stays inside qkv: no gradient to materialise (or to zero-fill)
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, *output, *mt, *st)
    ctx.meta = (ms, len(mt), ss, scale)
    ctx.need = [t.requires_grad for t in (q, k, v, *st)]


def _backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Any, ...]:
    ms, n_mask, ss, scale = ctx.meta
    q, k, v, out, lse, *rest = ctx.saved_tensors
    mt, st = rest[:n_mask], rest[n_mask:]
    grads = torch.ops.qkv.blocksparse_backward(
        q, k, v, out, lse, dout, dlse, ms, mt, ss, st, scale, ctx.need
    )
    dq, dk, dv, *ds = (g if n else None for g, n in zip(grads, ctx.need, strict=True))
    return dq, dk, dv, None, [None] * n_mask, None, ds, None, None


torch.library.register_autograd("qkv::blocksparse", _backward, setup_context=_setup)


def _dense_last(fused: bool, *ts: Tensor) -> list[Tensor]:
    # torch's fused kernel reads the last dim as dense: copy where it is not
    return [unit_last_stride(t) for t in ts] if fused else list(ts)


@contextmanager
def _autograd_inside() -> Iterator[None]:
    """Autograd recording inside an operator's implementation, which the dispatcher runs
    with the autograd keys excluded: the backward re-runs a score under autograd to
    differentiate the tensors it carries."""
    keys = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    kept = excluded.remove(keys.AutogradFunctionality).remove(keys.AutogradOther)
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, kept), torch.enable_grad():
        yield

"""The block-sparse engine's two registered operators, ``qkv::blocksparse`` and
``qkv::blocksparse_backward``: the one pipeline that eager calls and compiled graphs share.

Both carry the mask and the score as spec strings and tensor lists (:mod:`qkv._core.spec`),
which dynamo guards on and AOTAutograd traces through their fake implementations. An eager
call has planned its job already (the kept plan, bound to the call, a user's mod included):
it hands the job over as a :class:`Planned` value and its specs stay empty, so nothing is
planned twice; a compiled graph hands over none, and the operators plan from the specs when
the graph runs (its tiles read tensor values).

The autograd formula is registered once, on the forward operator's Autograd key
(:class:`_Attention`): its backward calls ``qkv::blocksparse_backward``, eagerly and in a
compiled graph alike. Gradients reach q, k, v and the score's tensors (a bias, ALiBi slopes,
a relative-bias table, the tensors a user's score_mod closes over), which the backward
differentiates by re-running the score under autograd.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._library.opaque_object import get_opaque_type_name, register_opaque_type
from torch.autograd.function import once_differentiable

from ..._core.kinds import MaskKind, ScoreKind
from ..._core.kindspec import mask_from_spec, mask_spec, score_from_spec, score_spec
from ..._core.lru import LRU
from ..._core.problem import Problem
from ..._core.spec import has_numbers, holds_tensors
from ..._planning.signature import native_setting
from ..base import unit_last_stride
from .autograd import captured
from .backward import backward
from .forward import forward
from .grads import huge_lse
from .job import Job
from .plan import make_job

Tensor = torch.Tensor

__all__ = ["NOT_PLANNED", "Planned", "attention", "attention_backward"]


class Planned:
    """An eager call's job, handed to the operators so that they run it as planned; a
    compiled graph hands :data:`NOT_PLANNED` (its tiles are planned when it runs). A value
    to torch.compile (equal when it holds the same job), which bakes only the empty one into
    a graph."""

    __slots__ = ("job",)

    def __init__(self, job: Job | None = None) -> None:
        self.job = job

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Planned) and other.job is self.job

    def __hash__(self) -> int:
        return id(self.job)

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        if self.job is not None:
            raise TypeError("an eager call's planned job cannot be written into a graph")
        return "Planned()", {"Planned": Planned}


NOT_PLANNED = Planned()
register_opaque_type(Planned, typ="value")

_LIB = torch.library.Library("qkv", "DEF")
_PLANNED = get_opaque_type_name(Planned)
_LIB.define(
    "blocksparse(Tensor q, Tensor k, Tensor v, str mask_spec, Tensor[] mask_tensors, "
    f"str score_spec, Tensor[] score_tensors, float scale, bool lse_grad, {_PLANNED}? plan=None)"
    " -> (Tensor, Tensor)"
)
_LIB.define(
    "blocksparse_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
    "Tensor? dlse, str mask_spec, Tensor[] mask_tensors, str score_spec, "
    f"Tensor[] score_tensors, float scale, bool[] need, {_PLANNED}? plan=None) -> Tensor[]"
)


def attention(
    job: Job, q: Tensor, k: Tensor, v: Tensor, score_tensors: list[Tensor], lse_grad: bool
) -> tuple[Tensor, Tensor]:
    """An eager call's ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq] float64)`` through
    ``qkv::blocksparse``: ``job`` bound to the call; ``score_tensors`` its bias (if any) and
    the tensors its score_mod closes over (``job.params``), which gradients reach."""
    out: tuple[Tensor, Tensor] = torch.ops.qkv.blocksparse(
        q, k, v, "", [], "", score_tensors, job.p.scale, lse_grad, Planned(job)
    )
    return out


def attention_backward(*args: Any) -> list[Tensor]:
    """``qkv::blocksparse_backward``'s arguments -> ``[dq, dk, dv, *d(score tensors)]``."""
    grads: list[Tensor] = torch.ops.qkv.blocksparse_backward(*args)
    return grads


# ------------------------------------------------------------------- the implementations


def _forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ms: str,
    mt: list[Tensor],
    ss: str,
    st: list[Tensor],
    scale: float,
    lse_grad: bool,
    plan: Planned | None = None,
) -> tuple[Tensor, Tensor]:
    eager = plan is not None and plan.job is not None
    job = plan.job if eager else _job(_problem(q, k, v, ms, mt, ss, st, scale), ms, ss)  # type: ignore[union-attr]
    assert job is not None
    # (a watched score_mod records its autograd graph to find tensors the engine missed)
    with _autograd_inside() if job.watch is not None else torch.no_grad():
        out, lse = forward(job, *_dense_last(job.fused, q, k, v))
    if eager:  # (no graph lays out what follows: a causal kernel's [B, L, H, D] view stays)
        return out, lse
    # contiguous, as the fake implementation says (a causal call's kernel writes [B, L, H, D])
    return out.contiguous(), lse.contiguous()


def _backward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    ms: str,
    mt: list[Tensor],
    ss: str,
    st: list[Tensor],
    scale: float,
    need: list[bool],
    plan: Planned | None = None,
) -> list[Tensor]:
    if plan is not None and plan.job is not None:  # eager: st is the bias, then params
        job = plan.job
        leaves = st
    else:  # planned with grad mode on, as a backward is (a bias needing one is not fused)
        with _autograd_inside(), torch.enable_grad():
            leaves = [t.detach().requires_grad_(n) for t, n in zip(st, need[3:], strict=True)]
            job = _job(_problem(q, k, v, ms, mt, ss, leaves, scale), ms, ss)
            job = job.for_run(params=tuple(captured(job.score_mod)) if job.score_mod else ())
    p = job.p
    if job.fused and huge_lse(lse):
        # Rows beyond what the fused kernel's recomputed scores keep exact (its backward
        # sums in another order than its forward: 5e-3 apart at scores of 1e4, measured;
        # torch's SDPA flash backward shares this) are redone with explicit matmuls,
        # which recompute bit-identical scores. qkv.plan says so in a note.
        job = make_job(p, matmul=True).for_run(seed=job.seed, params=job.params)
        with _autograd_inside() if job.watch is not None else torch.no_grad():
            out, lse = forward(job, q, k, v)
    bias_need = p.score.bias is not None and p.score.bias.requires_grad
    need_all = [*need[:3], bias_need, *(t.requires_grad for t in job.params)]
    qq, kk, vv = _dense_last(job.fused, q, k, v)
    # Autograd hands the operator zeros where nothing flowed into a returned lse: the
    # engine's backward then skips that term.
    d_lse = dlse if dlse is not None and bool(dlse.any()) else None
    # (a score_mod is differentiated by re-running it under autograd)
    with _autograd_inside() if job.score_mod is not None else torch.no_grad():
        g = backward(job, qq, kk, vv, out, lse, dout, d_lse, need_all)
    if leaves is st:  # eager: the bias (if any), then the params, in order
        ds = [*([g.dbias] if p.score.bias is not None else []), *g.dparams]
    else:  # the leaves made here, which the score's rebuilt mod closes over
        by_id = {id(t): d for t, d in zip(job.params, g.dparams, strict=True)}
        ds = [g.dbias if leaf is p.score.bias else by_id.get(id(leaf)) for leaf in leaves]
    # Contiguous, as the fake implementation says: the compiled backward views them by the
    # fake's strides (MultiHeadAttention's transposes back to [B, L, H*D] failed otherwise).
    grads = [
        g.dq.to(q.dtype).contiguous() if need[0] else q.new_empty(0),
        g.dk.to(k.dtype).contiguous() if need[1] else k.new_empty(0),
        g.dv.to(v.dtype).contiguous() if need[2] else v.new_empty(0),
    ]
    for t, d, n in zip(st, ds, need[3:], strict=True):
        if not n:
            grads.append(t.new_empty(0))
        else:  # a tensor no visible score reached gets zeros, as plain autograd gives
            d = torch.zeros(t.shape, dtype=t.dtype, device=t.device) if d is None else d
            grads.append(d.to(t.dtype).contiguous())
    return grads


_LIB.impl("blocksparse", _forward_impl, "CompositeExplicitAutograd")
_LIB.impl("blocksparse_backward", _backward_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("qkv::blocksparse", lib=_LIB)
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    B, Hq, Lq, _ = q.shape
    return q.new_empty(B, Hq, Lq, v.shape[3]), q.new_empty(B, Hq, Lq, dtype=torch.float64)


@torch.library.register_fake("qkv::blocksparse_backward", lib=_LIB)
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> list[Tensor]:
    score_tensors, need = args[7], args[9]
    return [
        t.new_empty(t.shape) if n else t.new_empty(0)  # contiguous, as the operator's are
        for t, n in zip([q, k, v, *score_tensors], need, strict=True)
    ]


# ------------------------------------------------------------- the autograd formula, once


class _Attention(torch.autograd.Function):
    """``qkv::blocksparse`` under autograd: the forward runs the operator below autograd and
    saves its log-sum-exp; the backward is ``qkv::blocksparse_backward``, which recomputes
    the probabilities from it (O(n) memory)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        specs: tuple[str, str, float, bool, Planned | None, int],
        *tensors: Tensor,
    ) -> tuple[Tensor, Tensor]:
        ms, ss, scale, lse_grad, plan, n_mask = specs
        mt, st = list(tensors[:n_mask]), list(tensors[n_mask:])
        with torch._C._AutoDispatchBelowAutograd():
            out, lse = torch.ops.qkv.blocksparse(q, k, v, ms, mt, ss, st, scale, lse_grad, plan)
        if not lse_grad:  # lse stays inside qkv: no gradient to materialise
            ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.specs = specs
        return out, lse

    @staticmethod
    @once_differentiable  # the recomputing backward is not itself differentiable: say so
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
        ms, ss, scale, _, plan, n_mask = ctx.specs
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mt, st = rest[:n_mask], rest[n_mask:]
        if dout is None:  # only the lse was used
            dout = torch.zeros_like(out)
        need = [*ctx.needs_input_grad[:3], *ctx.needs_input_grad[4 + n_mask :]]
        grads = torch.ops.qkv.blocksparse_backward(
            q, k, v, out, lse, dout, dlse, ms, mt, ss, st, scale, need, plan
        )
        dq, dk, dv, *ds = (g if n else None for g, n in zip(grads, need, strict=True))
        return dq, dk, dv, None, *([None] * n_mask), *ds


def _autograd_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ms: str,
    mt: list[Tensor],
    ss: str,
    st: list[Tensor],
    scale: float,
    lse_grad: bool,
    plan: Planned | None = None,
) -> tuple[Tensor, Tensor]:
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v, *st)):
        with torch._C._AutoDispatchBelowAutograd():  # (no graph to record: ~8 us less)
            out: tuple[Tensor, Tensor] = torch.ops.qkv.blocksparse(
                q, k, v, ms, mt, ss, st, scale, lse_grad, plan
            )
            return out
    res: tuple[Tensor, Tensor] = _Attention.apply(
        q, k, v, (ms, ss, scale, lse_grad, plan, len(mt)), *mt, *st
    )
    return res


_LIB.impl("blocksparse", _autograd_kernel, "Autograd")


# ----------------------------------------------------- a compiled graph's plan, at its run


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


# The kinds of specs without tensors (a window's, a softcap's), parsed once: a compiled
# graph's operators rebuild their problem at every run, forward and backward.
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
# windows, prefix-LM), kept by what planning reads: a compiled graph's forward and backward
# operators then plan once per shape, not at every run (an eager call hands over the job its
# signature kept). Bounded; a graph has few shapes.
_JOBS: LRU[tuple[object, ...], Job] = LRU(64)


def _job(p: Problem, ms: str, ss: str) -> Job:
    """``make_job(p)`` bound to ``p``, kept for masks without tensors (see ``_JOBS``); ``ms``
    and ``ss`` are ``p``'s specs. The key is what planning reads, the specs standing for the
    kinds (their tensors' values are read from the bound problem at every run)."""
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


def _dense_last(fused: bool, *ts: Tensor) -> list[Tensor]:
    # torch's fused kernel reads the last dim as dense: copy where it is not
    return [unit_last_stride(t) for t in ts] if fused else list(ts)


@contextmanager
def _autograd_inside() -> Iterator[None]:
    """Autograd available inside an operator's implementation, which the dispatcher runs
    with the autograd keys excluded: the backward re-runs a score under autograd to
    differentiate the tensors it carries. Grad mode stays off: the kernels turn it on
    around the score alone (recording the whole backward cost 80 us of a 500 us small
    call, measured)."""
    keys = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    kept = excluded.remove(keys.AutogradFunctionality).remove(keys.AutogradOther)
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, kept), torch.no_grad():
        yield

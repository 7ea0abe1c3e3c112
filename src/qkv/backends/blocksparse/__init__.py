"""The block-sparse backend: online-softmax attention over the tiles a block mask lets
through, with a backward that recomputes from the saved log-sum-exp (O(n) memory).

Three layers (STYLE.md rule 7): :class:`BlocksparseBackend` (what the planner sees) →
:class:`_BlockSparseAttention` (the ``torch.autograd.Function``) → the piece kernels in
``_blocksparse_fwd`` / ``_blocksparse_bwd``, planned by ``_blocksparse_plan``. Empty tiles
are never touched; full tiles run with no masking; partial tiles evaluate the mask for
themselves only.

Gradients reach a bias tensor and the tensors a callable score_mod closes over: those are
found by looking into the score_mod (closure cells, attributes, ``functools.partial``
arguments, ``nn.Module`` parameters, globals it names) and passed to the autograd Function as
inputs; in the backward the score_mod is re-run on each piece under autograd. If a probe shows
the score_mod depends on a learnable tensor that was not found, the engine falls back to
checkpointed per-block autograd, which is slower but still exact and O(n) in memory.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ..._validate import Problem
from ...blockmask import BlockMask
from ...masks import _Band
from ..base import Backend
from .backward import backward
from .forward import forward, row_forward
from .job import HiddenDependency, Job, fused_ok
from .plan import (
    _PIECE_BUDGET,
    _prefix_length,
    _segments,
    make_job,
    native_band,
)

Tensor = torch.Tensor


class _BlockSparseAttention(torch.autograd.Function):
    """``(job, q, k, v, bias, *params) -> (out, lse)`` with a recomputing backward."""

    @staticmethod
    def forward(
        ctx: Any, job: Job, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, *params: Tensor
    ) -> tuple[Tensor, Tensor]:
        out, lse = forward(job, q, k, v)
        ctx.job = job
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # the recomputing backward is not itself differentiable: say so
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
        job: Job = ctx.job
        q, k, v, out, lse = ctx.saved_tensors
        need = list(ctx.needs_input_grad[1:])
        if dout is None:
            dout = torch.zeros_like(out)
        g = backward(job, q, k, v, out, lse, dout, dlse, need)
        dbias = None
        if job.bias is not None and need[3] and g.dbias is not None:
            dbias = g.dbias.to(job.bias.dtype)
        # A parameter no visible score reached (every key masked) still gets a zero gradient,
        # as plain autograd would give it.
        dparams = [
            (torch.zeros_like(t) if n else None) if d is None else d.to(t.dtype)
            for d, t, n in zip(g.dparams, job.params, ctx.needs_input_grad[5:], strict=True)
        ]
        return (
            None,
            g.dq.to(q.dtype) if need[0] else None,
            g.dk.to(k.dtype) if need[1] else None,
            g.dv.to(v.dtype) if need[2] else None,
            dbias,
            *dparams,
        )


class BlocksparseBackend(Backend):
    """Block-sparse online-softmax attention on CPU and CUDA tensors."""

    name = "blocksparse"
    # Its memory is bounded per piece (O(n) overall), so the dense limit never applies.
    materialises_scores = False

    def rejects(self, p: Problem) -> str | None:
        return None

    def kernel(self, p: Problem) -> str:
        """How this backend will compute ``p`` (for :func:`qkv.plan`)."""
        why = fused_ok(p)
        if why is not None:
            return f"explicit matmuls per block ({why})"
        mask = p.mask.mask if isinstance(p.mask, BlockMask) else p.mask
        if not isinstance(p.score_mod, Tensor) and p.Lk > 0:
            segs = _segments(p, mask)
            if not segs and native_band(p, mask, build=False) is None:
                return (
                    "qkv's compiled band kernel (C++, built once on first use): each query "
                    "block against only the keys its rows see; the backward runs torch's fused "
                    "kernel"
                )
            if len(segs) == 1 and segs[0][:2] == (0, p.Lq):
                return "torch's fused CPU flash kernel on the whole problem (it returns the lse)"
            if segs and _prefix_length(mask) is not None:
                return (
                    f"torch's fused CPU flash kernel: prefix and causal parts ({len(segs)} "
                    f"calls, merged by lse)"
                )
            if segs:
                return f"torch's fused CPU flash kernel once per document ({len(segs)} calls)"
            if isinstance(mask, _Band) and p.Hq == p.Hkv:
                return (
                    "torch's fused CPU flash kernel, query blocks batched along the band "
                    "(strided views, visible key blocks only; the backward batches key "
                    "blocks, each against the queries that see it)"
                )
        return "torch's fused CPU flash kernel per query block, visible key blocks only"

    def extra_memory(self, p: Problem) -> int:
        cdt = torch.finfo(p.compute_dtype).bits // 8
        lse = p.B * p.Hq * p.Lq * cdt
        bq = 128
        dense_piece = p.B * p.Hq * min(p.Lq, bq) * p.Lk
        piece = min(dense_piece, _PIECE_BUDGET)
        if fused_ok(p) is None:
            # The float mask of one piece, plus head-dim padding copies when Dv != D.
            pad = 0
            if p.Dv != p.D:
                dm = max(p.D, p.Dv)
                pad = (p.q.numel() // max(1, p.D) + 2 * p.k.numel() // max(1, p.D)) * dm
                pad *= p.q.element_size()
            work = piece * p.q.element_size() + pad
        else:
            work = 4 * piece * cdt  # scores, exp, probabilities, their gradient
        grads = 0
        if p.requires_grad():
            grads = (p.q.numel() + p.k.numel() + p.v.numel()) * cdt
        tiles = -(-p.Lq // bq) * -(-p.Lk // bq)
        return int(lse + work + grads + tiles)

    def run(self, p: Problem) -> tuple[Tensor, Tensor | None]:
        if p.B * p.Hq * p.Lq == 0:
            out = p.q.new_zeros(p.B, p.Hq, p.Lq, p.Dv)
            lse = torch.full((p.B, p.Hq, p.Lq), float("-inf"), device=p.device)
            return out, (lse if p.return_lse else None)
        job = make_job(p)
        bias = job.bias
        watch = job.score_mod is not None and torch.is_grad_enabled()
        if watch:
            job.params = _captured(job.score_mod)
        inputs = [p.q, p.k, p.v, *([bias] if bias is not None else []), *job.params]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        if not (needs_grad or watch):
            with torch.no_grad():
                out, lse = forward(job, p.q, p.k, p.v)
            return out, (lse.float() if p.return_lse else None)
        if watch:
            job.hidden_check = functools.partial(_reaches_hidden, found=job.params)
        try:
            out, lse = _BlockSparseAttention.apply(job, p.q, p.k, p.v, bias, *job.params)
        except HiddenDependency:
            job.hidden_check = None
            return _maybe_lse(p, _checkpointed(job, p.q, p.k, p.v))
        if job.fused and needs_grad and _huge(lse):
            # The fused kernel recomputes the scores in its backward with a different
            # summation order than its forward; at scores of ~1e3 and beyond the two
            # differ by more than float32 noise (5e-3 at 1e4, measured), which scales
            # whole rows of the recomputed probabilities. torch's own SDPA flash backward
            # shares this. Explicit matmuls recompute bit-identical scores, so such
            # problems are redone with them (the forward runs twice, only here).
            job = make_job(p, matmul=True)
            out, lse = _BlockSparseAttention.apply(job, p.q, p.k, p.v, bias, *job.params)
        return _maybe_lse(p, (out, lse))


def _maybe_lse(p: Problem, res: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    out, lse = res
    return out, (lse.float() if p.return_lse else None)


# |lse| beyond which the fused kernel's recomputed scores are too far from its forward's.
_HUGE_LSE = 128.0


def _huge(lse: Tensor) -> bool:
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return bool((finite.abs() > _HUGE_LSE).any())


# ------------------------------------------------------------------ score_mod gradients


def _captured(score_mod: Any) -> list[Tensor]:
    """Tensors requiring grad that ``score_mod`` closes over: closure cells, defaults,
    globals it names, attributes, ``functools.partial`` arguments, module parameters."""
    found: list[Tensor] = []
    _collect(score_mod, found, set(), 0)
    return found


def _collect(obj: Any, out: list[Tensor], seen: set[int], depth: int) -> None:
    if id(obj) in seen or depth > 10:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        if obj.requires_grad:
            out.append(obj)
        return
    if isinstance(obj, torch.nn.Module):
        for t in (*obj.parameters(), *obj.buffers()):
            _collect(t, out, seen, depth + 1)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for x in obj:
            _collect(x, out, seen, depth + 1)
        return
    if isinstance(obj, dict):
        for x in obj.values():
            _collect(x, out, seen, depth + 1)
        return
    if isinstance(obj, functools.partial):
        _collect((obj.func, obj.args, obj.keywords), out, seen, depth + 1)
        return
    if inspect.ismethod(obj):
        _collect((obj.__self__, obj.__func__), out, seen, depth + 1)
        return
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in (obj.__closure__ or ()) if _has_contents(c)]
        names = [obj.__globals__[n] for n in obj.__code__.co_names if n in obj.__globals__]
        names = [x for x in names if not isinstance(x, (types.ModuleType, type))]
        _collect(
            (cells, obj.__defaults__ or (), obj.__kwdefaults__ or {}, names), out, seen, depth + 1
        )
        return
    if isinstance(obj, (types.ModuleType, type, str, bytes, int, float, bool)) or obj is None:
        return
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        _collect(attrs, out, seen, depth + 1)


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _reaches_hidden(out: Tensor, score: Tensor, found: list[Tensor]) -> bool:
    """Walk the autograd graph of a score_mod's ``out`` (computed from ``score``): True if it
    reaches a tensor requiring grad that is not among ``found`` (nor behind one of them)."""
    if out.grad_fn is None:
        return False
    stop = {id(t.grad_fn) for t in found if t.grad_fn is not None}
    leaves = {id(t) for t in found} | {id(score)}
    todo: list[Any] = [out.grad_fn]
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        if id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)
        if var is not None:  # an AccumulateGrad node: a leaf that requires grad
            if id(var) not in leaves:
                return True
            continue
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return False


def _checkpointed(job: Job, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Per-query-block autograd with activation checkpointing: exact gradients into whatever
    the score_mod uses, O(n) memory, slower than the custom backward."""
    p = job.p
    job.fused = False
    outs: list[tuple[int, int, Tensor, Tensor]] = []
    for pieces in job.fwd.rows:
        if not pieces:
            continue
        q0, q1 = pieces[0].q0, pieces[0].q1

        def one(q: Tensor, k: Tensor, v: Tensor, pieces: Any = pieces) -> tuple[Tensor, Tensor]:
            o, lse = row_forward(job, pieces, q, k, v)
            return o.to(p.compute_dtype), lse

        o, lse = checkpoint(one, q, k, v, use_reentrant=False)
        outs.append((q0, q1, o, lse))
    out_parts, lse_parts, at = [], [], 0
    for q0, q1, o, lse in outs:
        if q0 > at:  # query blocks that see nothing
            out_parts.append(q.new_zeros(p.B, p.Hq, q0 - at, p.Dv, dtype=p.compute_dtype))
            lse_parts.append(_neg_inf(p, q0 - at))
        out_parts.append(o)
        lse_parts.append(lse)
        at = q1
    if at < p.Lq:
        out_parts.append(q.new_zeros(p.B, p.Hq, p.Lq - at, p.Dv, dtype=p.compute_dtype))
        lse_parts.append(_neg_inf(p, p.Lq - at))
    out = torch.cat(out_parts, dim=2).to(p.dtype)  # [B, Hq, Lq, Dv]
    lse = torch.cat(lse_parts, dim=2)  # [B, Hq, Lq]
    return out, lse


def _neg_inf(p: Problem, rows: int) -> Tensor:
    return torch.full((p.B, p.Hq, rows), float("-inf"), dtype=torch.float64, device=p.device)

"""The block-sparse backend: online-softmax attention over the tiles a block mask lets
through, with a backward that recomputes from the saved log-sum-exp (O(n) memory).

The engine, one file a job:

- ``plan.py``      decides the route of a call (mask-free segments, the compiled band
                   kernel, band groups, or pieces) and describes it;
- ``schedule.py``  cuts a block mask into pieces and band groups within a memory budget;
- ``job.py``       the frozen job: schedule, mask and score sources, piece-level helpers;
- ``forward.py``   / ``backward.py``: the kernels per piece, group and segment;
- ``operators.py`` the registered operators (``qkv::blocksparse`` and its backward) every
                   call runs through, eager or compiled, with the one autograd formula;
- ``autograd.py``  how gradients reach a score_mod's tensors;
- ``native.py``    builds and loads ``kernels/band.cpp``, qkv's compiled CPU band kernel.

Three layers: :class:`BlocksparseBackend` (what the planner sees) → the operators
(:mod:`.operators`) → the kernels. Empty tiles are never touched; full
tiles run with no masking; partial tiles evaluate the mask for themselves only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from ..._core.problem import Problem
from ..._core.tiles import DEFAULT_BLOCK
from ..base import SMALL_DENSE, Backend, Recipe, Route, Runner, no_keys_result
from . import autograd, compiled, operators, schedule
from .autograd import captured, reaches_hidden
from .cost import Costs, weigh
from .job import HiddenDependency, Job, Watch, fused_ok
from .plan import block_mask_of, describe, make_job

Tensor = torch.Tensor

__all__ = ["BlocksparseBackend"]


class BlocksparseBackend(Backend):
    """Block-sparse online-softmax attention on CPU and CUDA tensors."""

    name = "blocksparse"
    # Its memory is bounded per piece (O(n) overall), so the dense limit never applies.
    materialises_scores = False

    def rejects(self, p: Problem) -> str | None:
        return None

    def claims(self, p: Problem) -> str | None:
        if torch.compiler.is_compiling():
            return None  # its planning reads tensor values: the reference formula traces
        if p.mask.is_none or p.mask.is_causal:
            return None  # (SDPA's own kernel computes them whole)
        costs = self.weigh(p)
        if costs is None:
            return None
        if costs.prefers_blocksparse:
            return str(costs)
        p.reads["declined"] = (self.name, str(costs))  # (the planner's note on its choice)
        return None

    def weigh(self, p: Problem) -> Costs | None:
        """The estimated costs of ``p`` here and on SDPA with the dense mask (:mod:`.cost`),
        read once per problem; ``None`` where SDPA cannot take ``p`` (nothing to weigh)."""
        got = p.reads.get("costs")
        if isinstance(got, Costs):
            return got
        if p.score.is_callable or p.return_lse or p.Lk == 0 or p.dropout_p > 0:
            return None  # (SDPA's own refusals, and dropout: not weighed)
        costs = weigh(p, make_job(p, dry_run=True))
        p.reads["costs"] = costs
        return costs

    def route(self, p: Problem, *, dry_run: bool = False) -> Route:
        if torch.compiler.is_compiling():
            # Its planning reads tensor values: while dynamo traces, the engine runs whole
            # as a custom operator, planned when the graph runs; what cannot cross one
            # runs eagerly behind a single graph break.
            why = compiled.why_not(p)
            return Route(
                forward="the block-sparse engine as one operator (qkv::blocksparse; its tiles "
                "planned when the compiled graph runs)"
                if why is None
                else f"the block-sparse engine, eagerly behind one graph break ({why})",
                backward="qkv::blocksparse_backward (the engine's recomputing backward)",
                extra_memory=_extra_memory(p),
                detail=None if why is None else _EAGER,
            )
        job = make_job(p, dry_run=dry_run)
        fwd, bwd = describe(job)
        notes = []
        if job.fused and p.requires_grad():
            notes.append(
                "rows with |lse| > 128 redo the call with explicit matmuls before a backward "
                "(the fused backward's recomputed scores drift there)"
            )
        if job.route == "native_band":
            notes.append(
                "the compiled kernel works in 16-row blocks against exactly the keys each "
                "block's rows see; the tiles line is the mask's plan at the default tile size"
            )
        if job.score_mod is not None:
            notes.append(
                "a score_mod that reaches a learnable tensor the engine cannot find falls "
                "back to checkpointed per-block autograd (exact, slower)"
            )
        if dry_run and p.B * p.Hq * p.Lq * p.Lk > SMALL_DENSE and (why := compiled.why_not(p)):
            notes.append(
                f"under torch.compile the engine's operator cannot take this call ({why}): "
                "the plain formula runs it in the graph, in chunks of query rows when all "
                "its scores would pass the dense limit; only if one row's do (or it needs "
                "over 256 chunks) does the engine run eagerly behind one graph break, which "
                "fullgraph=True refuses"
            )
        # The tile plan shown: the job's own, or (for routes that need none) the default one.
        block = job.block
        if block is None and dry_run and not p.mask.is_none:
            block = block_mask_of(p, (DEFAULT_BLOCK, DEFAULT_BLOCK))
        return Route(
            forward=fwd,
            backward=bwd,
            extra_memory=_extra_memory(p),
            block=block,
            notes=tuple(notes),
            detail=job.unbound(),  # (a plan holds none of the call's tensors)
        )

    def keep(self, route: Route) -> Route:
        job = route.detail
        if isinstance(job, Job) and job.replan:
            return replace(route, block=None, detail=job.without_tiles())
        return route

    def runner(self, p: Problem, route: Route) -> Runner | None:
        if not isinstance(route.detail, Job):
            return None
        return _band_runner(p, route.detail)

    def run(self, p: Problem, route: Route) -> tuple[Tensor, Tensor | None]:
        if route.detail is None:  # the operators (while dynamo traces)
            out, lse = compiled.attention(p)
            return out, (lse if p.return_lse else None)
        if route.detail is _EAGER:  # (while dynamo traces)
            # (imported here: torch.compiler.disable imports dynamo, which must not happen
            # when qkv is imported; here dynamo is tracing, so it is loaded already)
            from .eager import eagerly

            m, s = p.mask.source, p.score.source
            return eagerly(self, p.q, p.k, p.v, m, s, p.scale, p.dropout_p, p.return_lse)
        job = route.detail
        assert isinstance(job, Job)
        # a kept job whose tiles were planned from another call's values plans this call's
        job = job.for_run(call=p) if job.tiles_for(p) else make_job(p)
        if p.B * p.Hq * p.Lq == 0:
            return no_keys_result(p)
        bias = job.bias
        watch = job.score_mod is not None and torch.is_grad_enabled()
        seed = int(torch.randint(0, 1 << 62, (1,)).item()) if p.dropout_p > 0 else 0
        params = tuple(captured(job.score_mod)) if watch else ()
        check = Watch(functools.partial(reaches_hidden, found=list(params))) if watch else None
        job = job.for_run(seed=seed, params=params, watch=check)
        # Through the engine's operator, as a compiled graph calls it; it runs this job.
        score_tensors = [*([bias] if bias is not None else []), *params]
        try:
            out, lse = operators.attention(job, p.q, p.k, p.v, score_tensors, p.return_lse)
        except HiddenDependency:
            return _maybe_lse(p, autograd.checkpointed(job.for_run(watch=None), p.q, p.k, p.v))
        return _maybe_lse(p, (out, lse))


@dataclass(frozen=True)
class Eagerly(Recipe):
    """Under torch.compile: the engine runs eagerly behind one graph break (what its
    operator cannot take). ``None`` as the recipe there means the operators run."""


_EAGER = Eagerly()


def _band_runner(p: Problem, job: Job) -> Runner | None:
    """The compiled band kernel's forward with everything but the tensors bound, for repeat
    calls that need no gradient (a sliding window in a model's forward under no_grad)."""
    if job.native_band is None or p.requires_grad() or p.B * p.Hq * p.Lq == 0:
        return None
    from . import native  # (imported here, as forward() does)

    (lo, hi) = job.native_band
    return native.band_runner(lo, hi, p.scale, native.extras(p.mask.terms, p.B))


def _extra_memory(p: Problem) -> int:
    cdt = torch.finfo(p.compute_dtype).bits // 8
    lse = p.B * p.Hq * p.Lq * cdt
    bq = 128
    dense_piece = p.B * p.Hq * min(p.Lq, bq) * p.Lk
    piece = min(dense_piece, schedule.PIECE_BUDGET)
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


def _maybe_lse(p: Problem, res: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    out, lse = res
    return out, (lse.to(p.compute_dtype) if p.return_lse else None)

"""How the block-sparse engine's gradients reach a score_mod's tensors (the autograd formula
itself is registered on the engine's operator, :mod:`.operators`).

Gradients reach a bias tensor and the tensors a callable score_mod closes over: those are
found by looking into the score_mod (closure cells, attributes, ``functools.partial``
arguments, ``nn.Module`` parameters, globals it names) and passed to the operator as inputs;
in the backward the score_mod is re-run on each piece under autograd. If a probe shows the
score_mod depends on a learnable tensor that was not found, the engine falls back to
checkpointed per-block autograd (:func:`checkpointed`), slower but still exact and O(n) in
memory.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import replace
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..._core.problem import Problem
from .forward import row_forward
from .job import Job

Tensor = torch.Tensor


# ------------------------------------------------------------------ score_mod gradients


def captured(score_mod: Any) -> list[Tensor]:
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


def reaches_hidden(out: Tensor, score: Tensor, found: list[Tensor]) -> bool:
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


def checkpointed(job: Job, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Per-query-block autograd with activation checkpointing: exact gradients into whatever
    the score_mod uses, O(n) memory, slower than the custom backward."""
    p = job.p
    job = replace(job, fused=False)
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

"""Repeat calls without a mask or score_mod: the decision made once per call signature.

A decoder calls attention with the same shapes in every layer and, while decoding, with
shapes that differ only in the cache length. With no mask and no score_mod the plan depends on
nothing but the tensors' shapes, dtypes, devices and autograd flags and the call's scalars, so
the first call of a signature runs the full door (``validate``) and the planner; later calls
with the same signature reuse its route. The signature holds everything the checks and the
decision read, so a hit is a call the full path has already accepted and would decide the same
way. Only routes that carry nothing of the first call's tensors are kept (SDPA's and the
decode kernel's; the block-sparse and Triton routes hold per-call jobs). Measured on a GQA
decode step (benchmarks/RESULTS.md, issue 10): validate + decide cost ~15 us a call, the
lookup ~2 us.
"""

from __future__ import annotations

import torch

from . import planner
from ._kinds import NO_MASK, NO_SCORE
from ._problem import Problem
from .backends import BACKENDS
from .backends.base import Route

Tensor = torch.Tensor

_ROUTES: dict[tuple[object, ...], tuple[str, Route, float]] = {}
_KEPT = ("sdpa", "decode")  # routes that carry nothing of the call that made them
_MAX = 512  # signatures kept (a model's layers share one; decoding adds one per length)


def signature(
    q: object, k: object, v: object, scale: object, return_lse: bool, backend: object
) -> tuple[object, ...] | None:
    """The key of a call, or ``None`` when it is not one this cache takes."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return None  # subclasses and non-tensors take the full path (and its errors)
    if q.ndim != 4 or not (scale is None or type(scale) is float):
        return None
    grad = torch.is_grad_enabled()
    return (
        q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
        grad and q.requires_grad, grad and k.requires_grad, grad and v.requires_grad,
        scale, return_lse, backend, planner.dense_limit(),
    )  # fmt: skip


def lookup(
    key: tuple[object, ...], q: Tensor, k: Tensor, v: Tensor, return_lse: bool
) -> tuple[str, Problem, Route] | None:
    """The cached decision for ``key`` with a problem of these tensors, or ``None``."""
    got = _ROUTES.get(key)
    if got is None:
        return None
    name, route, scale = got
    p = Problem(
        q=q, k=k, v=v, mask=NO_MASK, score=NO_SCORE, scale=scale, dropout_p=0.0,
        return_lse=return_lse, orig_ndim=4,
    )  # fmt: skip
    return name, p, route


def keep(key: tuple[object, ...], plan: planner.Plan) -> None:
    """Remember a plan made by the full path for ``key`` when its route can be reused."""
    route = plan.route
    if route.detail is not None or route.block is not None or plan.backend not in _KEPT:
        return
    if len(_ROUTES) >= _MAX:
        _ROUTES.clear()
    _ROUTES[key] = (plan.backend, route, plan.problem.scale)


def run(name: str, p: Problem, route: Route) -> tuple[Tensor, Tensor | None]:
    return BACKENDS[name].run(p, route)

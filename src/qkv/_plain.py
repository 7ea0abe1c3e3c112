"""Repeat calls without a score_mod: the decision made once per call signature.

A decoder calls attention with the same shapes in every layer and, while decoding, with
shapes that differ only in the cache length. With no score_mod and no mask, or one of qkv's
band masks (``qkv.causal``, ``qkv.sliding_window``, the KV cache's and qkv.hf's shifted bands,
which every layer of a forward shares), the plan depends on nothing but the tensors' shapes,
dtypes, devices and autograd flags, the mask object and the call's scalars, so
the first call of a signature runs the full door (``validate``) and the planner; later calls
with the same signature run its route as a function of the tensors alone (the backend's
``runner``: no problem object, nothing decided again). The signature holds everything the
checks and the decision read, so a hit is a call the full path has already accepted and would
decide the same way. Only backends whose routes carry nothing of the first call's tensors
give runners (SDPA and the decode kernel; the block-sparse and Triton routes hold per-call
jobs). Measured on a GQA decode step (benchmarks/RESULTS.md): validate + decide
cost ~15 us a call, the lookup ~2 us; inside a model, where the weights streaming past evict
Python's own data between calls, every line of this path costs several times more.
"""

from __future__ import annotations

import torch

from . import planner
from .backends import BACKENDS
from .backends.base import Runner
from .masks import _Band

Tensor = torch.Tensor

_ROUTES: dict[tuple[object, ...], Runner] = {}
_MASKS = ("none", "causal", "band")  # what a kept call's mask classifies as
_MAX = 512  # signatures kept (a model's layers share one; decoding adds one per length)


def signature(
    q: object,
    k: object,
    v: object,
    mask: object,
    scale: object,
    return_lse: bool,
    backend: object,
) -> tuple[object, ...] | None:
    """The key of a call, or ``None`` when it is not one this cache takes. A band mask is part
    of the key as the object itself (hashed by identity; the kept key holds it, so its id is
    not reused while it is kept): a band holds no tensors and nothing in it changes."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return None  # subclasses and non-tensors take the full path (and its errors)
    if q.ndim != 4 or not (scale is None or type(scale) is float):
        return None
    if mask is not None and type(mask) is not _Band:
        return None
    grad = torch.is_grad_enabled()
    return (
        q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
        grad and q.requires_grad, grad and k.requires_grad, grad and v.requires_grad,
        mask, scale, return_lse, backend, planner.dense_limit(),
    )  # fmt: skip


def lookup(key: tuple[object, ...]) -> Runner | None:
    """The runner of the route decided for ``key`` before, or ``None``."""
    return _ROUTES.get(key)


def keep(key: tuple[object, ...], plan: planner.Plan) -> None:
    """Remember a plan made by the full path for ``key`` when its backend can repeat its route
    from the tensors alone (:meth:`qkv.backends.base.Backend.runner`)."""
    if plan.problem.mask.kind not in _MASKS or plan.problem.score.kind != "none":
        return
    runner = BACKENDS[plan.backend].runner(plan.problem, plan.route)
    if runner is None:
        return
    if len(_ROUTES) >= _MAX:
        _ROUTES.clear()
    _ROUTES[key] = runner

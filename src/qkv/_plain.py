"""Repeat calls without a score_mod: the decision made once per call signature.

A decoder calls attention with the same shapes in every layer and, while decoding, with
shapes that differ only in the cache length. With no score_mod and no mask, one of qkv's band
masks (``qkv.causal``, ``qkv.sliding_window``, the KV cache's and qkv.hf's shifted bands, which
every layer of a forward shares), or a document or padding mask (keyed on its tensors'
identities and version counters: an in-place edit is a new signature), the plan depends on
nothing but the tensors' shapes, dtypes, devices and autograd flags, the mask, the call's
scalars and ``QKV_NATIVE``, so the first call of a signature runs the full door
(``validate``) and the planner; later calls with the same signature run its route as a
function of the tensors alone (the backend's ``runner``: no problem object, nothing decided
again; SDPA binds a mask's dense tensor once). The signature holds everything the checks and
the decision read, so a hit is a call the full path has already accepted and would decide the
same way. Backends give runners where their route can be bound once: SDPA, the decode kernel,
and the block-sparse engine's compiled band kernel without gradients (its other routes and
Triton's hold per-call jobs). Measured on a GQA decode step (benchmarks/RESULTS.md): validate
+ decide cost ~15 us a call, the lookup ~2 us; on a small masked call (B=4 H=4 L=48 D=32) the
full path cost 2.2x SDPA given the dense mask, a kept runner 1.1x.
"""

from __future__ import annotations

import os

import torch

from . import planner
from .backends import BACKENDS
from .backends.base import Runner
from .masks import _Band, _Document, _KvBelow

Tensor = torch.Tensor

_ROUTES: dict[tuple[object, ...], Runner] = {}
# what a kept call's mask classifies as
_MASKS = ("none", "causal", "band", "document", "padding", "prefix")
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
    """The key of a call, or ``None`` when it is not one this cache takes. A built-in mask is
    part of the key as the object itself (hashed by identity; the kept key holds it, so its id
    is not reused while it is kept): a band holds no tensors and nothing in it changes; a
    document or padding mask's tensors enter as (identity, version counter), so an in-place
    edit of its ids or lengths is a new signature. ``QKV_NATIVE`` is part of it (the decision
    reads it)."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return None  # subclasses and non-tensors take the full path (and its errors)
    if torch.compiler.is_compiling():
        return None  # traced once: a kept runner saves nothing there (and versions are symbolic)
    if q.ndim != 4 or not (scale is None or type(scale) is float):
        return None
    held: tuple[object, ...] | None = ()
    if mask is not None:
        kind = type(mask)
        if kind is _Document:
            held = _versions((mask.ids,))  # type: ignore[attr-defined]
        elif kind is _KvBelow:
            held = _versions((mask.limit, mask.start))  # type: ignore[attr-defined]
        elif kind is not _Band:
            return None
        if held is None:
            return None
    grad = torch.is_grad_enabled()
    return (
        q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
        grad and q.requires_grad, grad and k.requires_grad, grad and v.requires_grad,
        mask, held, scale, return_lse, backend, planner.dense_limit(),
        _native_setting(),
    )  # fmt: skip


# os.environ.get costs ~1 us a call (it encodes the key), as much as the rest of the signature;
# on POSIX its backing dict of bytes is read in ~30 ns, and stays in step with it (setenv,
# monkeypatch.setenv and os.environ[...] = ... all write there).
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _native_setting() -> object:
    """``QKV_NATIVE`` as the planner will read it (it decides whether compiled kernels run)."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(b"QKV_NATIVE")
    return os.environ.get("QKV_NATIVE")


def _versions(values: tuple[object, ...]) -> tuple[object, ...] | None:
    """Tensors as (identity, version counter); anything else (an int limit, None) as is.
    ``None`` when a tensor is an inference tensor: it has no version counter, so an in-place
    edit could not be told apart (such a mask takes the full path every call)."""
    if any(isinstance(t, Tensor) and t.is_inference() for t in values):
        return None
    return tuple((id(t), t._version) if isinstance(t, Tensor) else t for t in values)


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

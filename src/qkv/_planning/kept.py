"""Plans kept under their call's signature (:mod:`qkv._planning.signature`).

:func:`qkv.planner.decide` keeps what it decides here and looks here first; a repeat call of
:func:`qkv.attention` with a runner kept runs it before any check
(:func:`qkv.planner.repeat`). A decision that read the logits (whether a gradient's
recomputing backward would lose precision) is kept per answer. Bounded: at most 512 keys,
the least recently used going first (:class:`qkv._core.lru.LRU`), and a key whose signature
holds a freed tensor or mod (it can never be met again) is forgotten when that object is
freed.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from .._core.kindspec import Unwatched
from .._core.lru import LRU
from .._core.problem import Problem
from ..backends import BACKENDS
from ..backends.base import HUGE_LOGIT, Runner, logit_bound
from .signature import SCALE, Signature

Tensor = torch.Tensor


class Kept(NamedTuple):
    """A plan kept under a signature, and its route as a function of the tensors alone when
    the backend gives one (:meth:`qkv.backends.base.Backend.runner`)."""

    plan: Any  # a qkv.planner.Plan (the planner imports this module, not the other way)
    runner: Runner | None


# a kept key -> weak references (with callbacks) to what its signature holds weakly
_GUARDS: dict[object, list[weakref.ref[Any]]] = {}
_MAX_KEPT = 512  # a model's layers share one signature; decoding adds one per cache length


def _evicted(key: object) -> None:
    _GUARDS.pop(key, None)


# signature (or (signature, huge)) -> kept plan
_KEPT: LRU[object, Kept | _ByLogits] = LRU(_MAX_KEPT, on_evict=_evicted)


class _ByLogits:
    """What a signature whose decision read the logits keeps: look up per answer."""


_BY_LOGITS = _ByLogits()


def lookup(sig: tuple[object, ...], q: Tensor, k: Tensor) -> Kept | None:
    """The plan kept for ``sig`` (a :class:`~qkv._planning.signature.Signature`, or a plain
    tuple equal to one; ``q`` and ``k``: the call's, for a decision that read the logits), or
    ``None``."""
    got = _KEPT.get(sig)
    if got is _BY_LOGITS:
        scale: float = sig[SCALE]  # type: ignore[assignment]
        got = _KEPT.get((sig, logit_bound(q, k, scale) > HUGE_LOGIT))
    return got  # type: ignore[return-value]


def clear() -> None:
    """Forget every kept plan (the next call of each signature is decided again)."""
    _KEPT.clear()
    _GUARDS.clear()


def keep(sig: Signature, plan: Any, p: Problem) -> None:
    """Keep ``plan``, decided for ``p``, under ``p``'s signature ``sig`` (with the runner its
    backend gives, if any), until a tensor or mod the signature holds weakly is freed (or it
    is the least recently used of more than ``_MAX_KEPT``)."""
    backend = BACKENDS[plan.backend]
    plan = replace(plan, route=backend.keep(plan.route))
    # (no runner for a mask whose values a signature does not watch: it would reuse them)
    runner = None if isinstance(sig.mask, Unwatched) else backend.runner(p, plan.route)
    entry = Kept(plan, runner)
    huge = p.reads.get("huge_logits")
    if huge is None:
        _KEPT.put(sig, entry)
        keys: tuple[object, ...] = (sig,)
    else:
        _KEPT.put(sig, _BY_LOGITS)
        _KEPT.put((sig, huge), entry)
        keys = (sig, (sig, huge))
    # A signature whose tensors (document ids, padding lengths, a bias) or mod are freed can
    # never be met again: forget its plan then, and what its runner holds (a dense mask).
    held = [t for r in _weak_refs(sig) if (t := r()) is not None]
    if held:

        def forget(_: object, keys: tuple[object, ...] = keys) -> None:
            for key in keys:
                _KEPT.pop(key)
                _GUARDS.pop(key, None)

        _GUARDS[keys[-1]] = [weakref.ref(t, forget) for t in held]


def _weak_refs(value: object) -> list[weakref.ref[Any]]:
    """The weak references inside a signature (its tokens' tensors and mods)."""
    if isinstance(value, weakref.ref):
        return [value]
    if isinstance(value, tuple):
        return [r for item in value for r in _weak_refs(item)]
    return []

"""What :func:`qkv.plan` says about mods evaluated through ``torch.vmap``, and what they cost.

A mask_mod or score_mod that works only under FlexAttention's vmap convention is evaluated
per element (``qkv._flex.compat``). The plan says so in a note, with the cost measured when
the plan is made: a typical mod (a table lookup) through vmap against the same mod under
broadcasting, on a 128x128 tile, and the user's mod itself on a tile of the problem.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from .._core.evaluate import grid
from .compat import ModCall, _is_qkv, _items, _probe, vmap_grid
from .traceable import message, untraceable

Tensor = torch.Tensor

_TILE = 128  # the tile the cost is measured on (qkv's default block)
_typical: dict[tuple[str, str], tuple[float, float]] = {}  # (kind, device) -> seconds


def _user_mods(obj: Any, depth: int = 0) -> list[Any]:
    """The user's mods in ``obj`` as qkv calls them: a :class:`ModCall` (through vmap, or not
    decided yet) or the function itself (broadcast)."""
    if isinstance(obj, ModCall) or (callable(obj) and not _is_qkv(obj)):
        return [obj]
    if depth > 6 or isinstance(obj, Tensor) or not _is_qkv(obj):
        return []
    attrs = getattr(obj, "__dict__", {})  # a BlockMask's mask_mod, and what _adopt wraps
    inner = [x for a in ("mask_mod", "mod", "mods") for x in _items(attrs.get(a))]
    return [w for x in inner for w in _user_mods(x, depth + 1)]


def _wrappers(obj: Any) -> list[ModCall]:
    return [w for w in _user_mods(obj) if isinstance(w, ModCall)]


def _seconds(f: Callable[[], Any], device: torch.device) -> float:
    best = float("inf")
    for _ in range(6):  # the first call warms up; the best of the rest
        t0 = time.perf_counter()
        f()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _args(kind: str, idx: tuple[Tensor, ...], dtype: torch.dtype) -> tuple[Tensor, ...]:
    """A mod's arguments on the tile of ``idx``; a zero score first for a score_mod (only
    qkv.plan calls one on scores that are not real)."""
    if kind == "mask_mod":
        return idx
    shape = torch.broadcast_shapes(*(t.shape for t in idx))
    return (torch.zeros(shape, dtype=dtype, device=idx[0].device), *idx)


def _typical_cost(kind: str, device: torch.device) -> tuple[float, float]:
    """Seconds a typical mod (a table lookup) takes on a 128x128 tile through vmap and under
    broadcasting; measured once per process and device."""
    key = (kind, str(device))
    if key not in _typical:
        t = torch.rand(_TILE, _TILE, device=device)
        args = _args(kind, grid((0, 1), (0, 1), (0, _TILE), (0, _TILE), device), t.dtype)
        if kind == "mask_mod":
            fn: Callable[..., Tensor] = lambda b, h, q, k: t[q, k] > 0.5  # noqa: E731
        else:
            fn = lambda s, b, h, q, k: s + t[q, k]  # noqa: E731
        with torch.no_grad():
            _typical[key] = (
                _seconds(lambda: vmap_grid(fn, args, t.dtype), device),
                _seconds(lambda: fn(*args), device),
            )
    return _typical[key]


def plan_notes(p: Any) -> list[str]:
    """A note for each mod of problem ``p`` evaluated through vmap, with its cost measured
    now (qkv.plan). A mod not called yet (a score_mod) is decided here on the probe tile."""
    if p.device.type == "meta" or p.B * p.Hq * p.Lq * p.Lk == 0:
        return []
    notes = []
    for w in _wrappers(p.mask.mask_mod) + _wrappers(p.score.score_mod):
        with torch.no_grad():
            if not w.decided:
                w(*_args(w.role, _probe(p.B, p.Hq, p.Lq, p.Lk, p.device), p.compute_dtype))
            if w.why is None:
                continue
            r, c = min(p.Lq, _TILE), min(p.Lk, _TILE)
            args = _args(w.role, grid((0, 1), (0, 1), (0, r), (0, c), p.device), p.compute_dtype)
            own = _seconds(functools.partial(w, *args), p.device)
        tv, tb = _typical_cost(w.role, p.device)
        notes.append(
            f"{w.role} {w.__name__} is evaluated through torch.vmap ({w.why}): about "
            f"{tv / tb:.1f}x slower to evaluate than a broadcast mod (a table lookup on a "
            f"{_TILE}x{_TILE} tile: {tv * 1e6:.0f} us through vmap, {tb * 1e6:.0f} us "
            f"broadcast; {w.__name__} takes {own * 1e6:.0f} us on a {r}x{c} tile of one (b, h))"
        )
    return notes + _trace_notes(p)


def _trace_notes(p: Any) -> list[str]:
    """A note for each user mod dynamo cannot trace: what ``torch.compile(fullgraph=True)``
    refuses it with (:mod:`qkv._flex.traceable`), asked on the same probe."""
    notes = []
    probe = _probe(1, 1, 2, 2, p.device)
    for kind, obj in (("mask_mod", p.mask.mask_mod), ("score_mod", p.score.score_mod)):
        for call in _user_mods(obj):
            fn = call.fn if isinstance(call, ModCall) else call
            if isinstance(call, ModCall) and call.why is None:
                call = fn  # decided: broadcasting works, so the function itself is called
            args = _args(kind, probe, torch.float32)
            why = untraceable(kind, fn, call, args)
            if why is not None:
                notes.append(message(kind, fn, why))
    return notes

"""What :func:`qkv.plan` shows of a call beyond its decision: names, density, tiles, notes.

Computed from the call's values when a plan is shown (never when a call runs), and kept as
plain values: a :class:`qkv.planner.Plan` holds none of the call's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core.problem import Problem
from .._flex.plan import plan_notes
from ..backends.base import Route
from ..native import NativeLibrary


@dataclass(frozen=True)
class About:
    """What :func:`qkv.plan` shows of one call beyond its decision, as plain values."""

    shape: tuple[tuple[str, int], ...]
    dtype: torch.dtype
    mask: str
    score_mod: str
    density: float | None
    tiles: str | None
    mod_notes: tuple[str, ...]  # mods evaluated through vmap, and their cost
    # a compiled kernel the route runs that is not built for this CPU yet (the dry run
    # builds nothing): the first call stalls for its build
    kernel_notes: tuple[str, ...] = ()


def describe(p: Problem, route: Route, backend: str = "") -> About:
    """What :func:`qkv.plan` shows of ``p`` run by ``route`` of ``backend``."""
    # the mod notes first: they decide a score_mod, which is then named by how it runs
    mod_notes = tuple(plan_notes(p))
    shape = {"B": p.B, "Hq": p.Hq, "Hkv": p.Hkv, "Lq": p.Lq, "Lk": p.Lk, "D": p.D, "Dv": p.Dv}
    return About(
        shape=tuple(shape.items()),
        dtype=p.dtype,
        mask=p.mask.name,
        score_mod=p.score.name,
        density=_density(p),
        tiles=_tiles(p, route),
        mod_notes=mod_notes,
        kernel_notes=_unbuilt(backend, route),
    )


def _unbuilt(backend: str, route: Route) -> tuple[str, ...]:
    """A note for the compiled library the route would run when it is not built yet."""
    lib = _library(backend, route)
    if lib is None or lib.built():
        return ()
    return (
        f"qkv's {lib.what} is not built yet: the first call builds it ({lib.estimate()}, "
        f"once for this CPU); `qkv build` builds it ahead",
    )


def _library(backend: str, route: Route) -> NativeLibrary | None:
    """The compiled library a route runs: the decode backend's kernel, or the block-sparse
    engine's band kernel where its job takes the ``native_band`` route."""
    if backend == "decode":
        from ..backends.decode import LIBRARY

        return LIBRARY
    if backend == "blocksparse" and getattr(route.detail, "route", None) == "native_band":
        from ..backends.blocksparse.native import LIBRARY as BAND

        return BAND
    return None


def _tiles(p: Problem, route: Route) -> str | None:
    bm = route.block
    if bm is None:
        return None
    n = bm.num_blocks
    bq, bk = bm.block_size
    text = (
        f"{n['full'] + n['partial']} of {bm.states.numel()} tiles of {bq}x{bk} computed "
        f"({n['partial']} partial), {bm.block_density():.1%} of the dense work"
    )
    if bm.evaluated:
        where = "on meta tensors (no data)" if p.device.type == "meta" else "tile by tile"
        text += f"; evaluated {where}: {', '.join(bm.evaluated)}"
    return text


def _density(p: Problem) -> float | None:
    """Exact fraction of visible pairs for band masks and tensors; None when unknown cheaply."""
    m, n = p.mask, p.Lq * p.Lk
    if m.is_none:
        return 1.0
    if n == 0:
        return 0.0
    if m.tensor is not None:
        if m.tensor.device.type == "meta":
            return None
        return float(m.tensor.expand(p.shape).float().mean()) if m.tensor.numel() else 0.0
    if m.is_band:
        i = torch.arange(p.Lq, dtype=torch.float64)
        lo = (i + (m.lo if m.lo is not None else -p.Lk)).clamp(0, p.Lk)
        hi = (i + (m.hi if m.hi is not None else p.Lk) + 1).clamp(0, p.Lk)
        return float((hi - lo).clamp(min=0).sum()) / n
    return None

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


def describe(p: Problem, route: Route) -> About:
    """What :func:`qkv.plan` shows of ``p`` run by ``route``."""
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
    )


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

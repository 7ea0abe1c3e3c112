"""Tile states of a mask: which ``bq x bk`` blocks of the score matrix are empty (0), partial
(1) or full (2).

:func:`classify` asks a built-in mask for its own analytic rule (``tile_states`` on its class
in :mod:`qkv._core.builtin_mods`, written with :mod:`qkv._core.grid`), which touches only
block bounds; and/or trees combine their parts' states; bool tensors and mask_mods are
evaluated tile by tile within ``EVAL_BUDGET`` positions.
"""

from __future__ import annotations

import torch

from .builtin_mods import BuiltinMask
from .combinations import Combined
from .evaluate import mask_at
from .grid import DEFAULT_BLOCK, EMPTY, EVAL_BUDGET, FULL, PARTIAL, Grid
from .kinds import MaskKind

Tensor = torch.Tensor

__all__ = ["DEFAULT_BLOCK", "EMPTY", "EVAL_BUDGET", "FULL", "PARTIAL", "Grid", "classify"]


def classify(g: Grid, m: MaskKind) -> Tensor:
    """int8 states broadcastable to ``[B, H, nq, nk]`` for a classified mask: a built-in
    mask by its own rule (no position evaluated), an and/or tree part by part (a part
    with no rule evaluated alone), bool tensors and mask_mods evaluated tile by tile."""
    mod = m.mask_mod
    if m.parts and isinstance(mod, Combined):
        out = classify(g, m.parts[0])
        for part in m.parts[1:]:
            out = mod.combine_states(out, classify(g, part))
        return out
    if isinstance(mod, BuiltinMask):
        states = mod.tile_states(g)
        if states is not None:
            return states
    g.evaluated.append(m.name)
    return _evaluate(m, g)


def _tile_rows(g: Grid) -> tuple[int, int]:
    """Rows and columns per evaluation tile (multiples of the block sizes) within the budget."""
    bh = g.B * g.H
    cols = g.nk * g.bk
    rows = max(g.bq, (EVAL_BUDGET // max(1, bh * cols)) // g.bq * g.bq)
    if bh * g.bq * cols > EVAL_BUDGET:  # even one block row is too wide: split the keys too
        cols = max(g.bk, (EVAL_BUDGET // (bh * g.bq)) // g.bk * g.bk)
    return rows, cols


def _evaluate(m: MaskKind, g: Grid) -> Tensor:
    """Evaluate a mask_mod (or slice a bool tensor) tile by tile and reduce each block to
    empty / partial / full. Memory is bounded by ``EVAL_BUDGET`` positions per tile."""
    t = m.tensor
    if g.device.type == "meta" or (t is not None and t.device.type == "meta"):
        # No data to evaluate (qkv.plan on meta tensors): every block may hold anything.
        return torch.ones(1, 1, g.nq, g.nk, dtype=torch.int8)
    if g.Lq == 0 or g.Lk == 0:
        return torch.zeros(1, 1, g.nq, g.nk, dtype=torch.int8)
    rows, cols = _tile_rows(g)
    states: Tensor | None = None
    for r0 in range(0, g.Lq, rows):
        r1 = min(g.Lq, r0 + rows)
        for c0 in range(0, g.Lk, cols):
            c1 = min(g.Lk, c0 + cols)
            tile_mask = mask_at(m, (0, g.B), (0, g.H), (r0, r1), (c0, c1), g.device)
            assert tile_mask is not None  # "none" has a rule
            tile = _reduce_tile(tile_mask, r1 - r0, c1 - c0, g.bq, g.bk).cpu()  # [b', h', nrb, ncb]
            if states is None or states.shape[:2] != tile.shape[:2]:
                lead = (
                    tile.shape[:2]
                    if states is None
                    else torch.broadcast_shapes(states.shape[:2], tile.shape[:2])
                )
                new = torch.zeros(*lead, g.nq, g.nk, dtype=torch.int8)
                if states is not None:
                    new.copy_(states.expand_as(new))
                states = new
            states[
                :,
                :,
                r0 // g.bq : r0 // g.bq + tile.shape[2],
                c0 // g.bk : c0 // g.bk + tile.shape[3],
            ] = tile
    if states is None:  # Lq == 0 or Lk == 0
        return torch.zeros(1, 1, g.nq, g.nk, dtype=torch.int8)
    return states


def _reduce_tile(m: Tensor, rows: int, cols: int, bq: int, bk: int) -> Tensor:
    """``m [b', h', rows|1, cols|1]`` bool → int8 states ``[b', h', rows/bq, cols/bk]``
    (rounded up)."""
    m = m.expand(m.shape[0], m.shape[1], rows, cols)
    nr, nc = -(-rows // bq), -(-cols // bk)
    pr, pc = nr * bq - rows, nc * bk - cols
    if pr or pc:
        # Positions past the lengths are not real: they must not make a block "any" visible
        # nor stop it from being "all" full, so reduce "any" over False and "all" over True.
        anym = torch.nn.functional.pad(m, (0, pc, 0, pr), value=False)
        allm = torch.nn.functional.pad(m, (0, pc, 0, pr), value=True)
    else:
        anym = allm = m
    lead = m.shape[:2]
    anyb = anym.reshape(*lead, nr, bq, nc, bk).any(dim=5).any(dim=3)  # [b', h', nr, nc]
    allb = allm.reshape(*lead, nr, bq, nc, bk).all(dim=5).all(dim=3)
    return anyb.to(torch.int8) + allb.to(torch.int8)


# ------------------------------------------------------------------ analytic rules

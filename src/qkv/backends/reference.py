"""The reference backend: :mod:`qkv.reference` (the oracle) run as a backend."""

from __future__ import annotations

import torch

from .. import reference
from .._core.problem import Problem
from .base import SMALL_DENSE, Backend, Route, score_bytes

Tensor = torch.Tensor


class ReferenceBackend(Backend):
    """Materialises the full score matrix; computes every problem; needs O(Lq·Lk) memory."""

    name = "reference"

    def rejects(self, p: Problem) -> str | None:
        return None

    def claims(self, p: Problem) -> str | None:
        # Under torch.compile the plain formula traces into one graph. It does all Lq*Lk
        # work, though: 2-7x eager's time for a window at n = 256-2048
        # (benchmarks/compile_matrix.py), so auto takes it for problems small enough that
        # eager computes them densely too, and beyond that only for what the block-sparse
        # engine's custom operator cannot take (a user's score_mod is code; dropout draws per
        # call), which would otherwise run eagerly behind a graph break. The dense limit
        # still applies: past it such calls do take the graph break.
        if not torch.compiler.is_compiling():
            return None
        if p.B * p.Hq * p.Lq * p.Lk <= SMALL_DENSE:
            return (
                "under torch.compile the plain formula traces into one graph; blocksparse "
                "would plan tiles for a problem this small"
            )
        if p.score.kind == "mod" or p.dropout_p > 0:
            what = "a user's score_mod (code)" if p.score.kind == "mod" else "dropout"
            return (
                f"under torch.compile the plain formula traces {what} into the graph; the "
                "block-sparse engine's operator cannot take it (O(Lq*Lk) memory, within the "
                "dense limit)"
            )
        return None

    def route(self, p: Problem, *, dry_run: bool = False) -> Route:
        # scores, exp(scores) and weights live at once (plus a dropout copy when asked), and
        # autograd keeps about as much again for the backward; a mask_mod is evaluated densely.
        copies = 3 + (1 if p.dropout_p > 0 else 0)
        dense = p.mask.kind not in ("none", "tensor")
        mask = p.B * p.Hq * p.Lq * p.Lk if dense else 0
        return Route(
            forward="materialises the full score matrix (the plain formula)",
            backward="autograd through the plain formula",
            extra_memory=score_bytes(p, copies) + mask,
            notes=("the reference materialises all Lq x Lk scores: O(n^2) memory",),
        )

    def run(self, p: Problem, route: Route) -> tuple[Tensor, Tensor | None]:
        out, lse, _ = reference.forward(p, dropout_p=p.dropout_p)
        return out, (lse if p.return_lse else None)

"""The reference backend: :mod:`qkv.reference` (the oracle) run as a backend."""

from __future__ import annotations

import torch

from .. import reference
from .._problem import Problem
from .base import SMALL_DENSE, Backend, Route, score_bytes

Tensor = torch.Tensor


class ReferenceBackend(Backend):
    """Materialises the full score matrix; computes every problem; needs O(Lq·Lk) memory."""

    name = "reference"

    def rejects(self, p: Problem) -> str | None:
        return None

    def claims(self, p: Problem) -> str | None:
        # Under torch.compile the block-sparse engine breaks the graph (its tile planning
        # reads tensor values; the band kernel is an opaque C++ op), while the plain formula
        # traces into one graph. It does all Lq*Lk work, though: 2-7x eager's time for a
        # window at n = 256-2048 (benchmarks/compile_matrix.py), so auto takes it only for
        # problems small enough that eager computes them densely too; larger ones run on
        # blocksparse with graph breaks, at eager's speed.
        if torch.compiler.is_compiling() and p.B * p.Hq * p.Lq * p.Lk <= SMALL_DENSE:
            return (
                "under torch.compile the plain formula traces into one graph; blocksparse "
                "would break it"
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

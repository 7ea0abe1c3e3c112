"""The reference backend: :mod:`qkv.reference` (the oracle) run as a backend."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .. import reference
from .._core.problem import Problem
from .base import DENSE_LIMIT, Backend, Recipe, Route, score_bytes, small_grid

Tensor = torch.Tensor

# Under torch.compile, the most query chunks the plain formula is cut into (each is traced
# apart, so the graph and its compile time grow with their number).
MAX_CHUNKS = 256


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
        # still applies: past it the formula works in chunks of query rows within it (see
        # route), and only a problem whose single row passes it takes the graph break.
        if not torch.compiler.is_compiling():
            return None
        if small_grid(p):
            return (
                "under torch.compile the plain formula traces into one graph; blocksparse "
                "would plan tiles for a problem this small"
            )
        if p.score.is_user or p.dropout_p > 0:
            what = "a user's score_mod (code)" if p.score.is_user else "dropout"
            return (
                f"under torch.compile the plain formula traces {what} into the graph; the "
                "block-sparse engine's operator cannot take it (all Lq*Lk work; in chunks of "
                "query rows past the dense limit)"
            )
        return None

    def route(self, p: Problem, *, dry_run: bool = False) -> Route:
        # scores, exp(scores) and weights live at once (plus a dropout copy when asked), and
        # autograd keeps about as much again for the backward; a mask_mod is evaluated densely.
        copies = 3 + (1 if p.dropout_p > 0 else 0)
        dense = not p.mask.is_none and p.mask.tensor is None
        full = score_bytes(p, copies) + (p.B * p.Hq * p.Lq * p.Lk if dense else 0)
        rows = _chunk_rows(p, full)
        if rows is None:
            return Route(
                forward="materialises the full score matrix (the plain formula)",
                backward="autograd through the plain formula",
                extra_memory=full,
                notes=("the reference materialises all Lq x Lk scores: O(n^2) memory",),
            )
        chunks = len(_bounds(p.Lq, rows)) - 1
        return Route(
            forward=f"the plain formula in {chunks} chunks of up to {rows} query rows, one "
            "chunk's scores at a time",
            backward="autograd through the plain formula, each chunk's scores recomputed "
            "(torch.utils.checkpoint)",
            extra_memory=math.ceil(full / p.Lq) * (rows + 2),
            notes=(
                "under torch.compile its Lq x Lk scores would pass the dense limit: the rows "
                "are cut into chunks that fit it, each traced into the graph",
            ),
            detail=Chunked(rows),
        )

    def run(self, p: Problem, route: Route) -> tuple[Tensor, Tensor | None]:
        if isinstance(route.detail, Chunked):
            return _in_chunks(p, route.detail.rows)
        out, lse, _ = reference.forward(p, dropout_p=p.dropout_p)
        return out, (lse if p.return_lse else None)


@dataclass(frozen=True)
class Chunked(Recipe):
    """The plain formula in chunks of ``rows`` query rows (under torch.compile, where all the
    scores at once would pass the dense limit)."""

    rows: int


def _chunk_rows(p: Problem, full: int) -> int | None:
    """Query rows per chunk when the plain formula runs a call in chunks: only while dynamo
    traces what the block-sparse engine's operator cannot take (a user's score_mod, dropout),
    when all its scores at once (``full`` bytes) would pass the dense limit and the rows fit
    it in at most :data:`MAX_CHUNKS` chunks; else ``None`` (the whole matrix at once)."""
    if not torch.compiler.is_compiling() or (not p.score.is_user and p.dropout_p == 0):
        return None
    limit = DENSE_LIMIT["bytes"]
    if full <= limit or p.Lq == 0:
        return None
    per_row = math.ceil(full / p.Lq)
    rows = limit // per_row - 2  # (the first two rows stay held for the backward)
    if rows <= 0 or len(_bounds(p.Lq, rows)) - 1 > MAX_CHUNKS:
        return None  # (over the limit whole: the planner refuses it with the figure)
    return rows


def _bounds(Lq: int, rows: int) -> list[int]:
    """Where the chunks of :func:`_in_chunks` start, and ``Lq``: two rows, then ``rows`` at a
    time."""
    return [0, *range(min(2, Lq), Lq, rows), Lq]


def _in_chunks(p: Problem, rows: int) -> tuple[Tensor, Tensor | None]:
    """The plain formula over query rows ``rows`` at a time (after the first two), each chunk
    but the first checkpointed (its backward recomputes its scores): ``out [B, Hq, Lq, Dv]``
    and ``lse``."""
    import torch.utils.checkpoint  # (imports dynamo: only ever called while dynamo traces)

    def chunk(r0: int, r1: int) -> tuple[Tensor, Tensor]:
        out, lse, _ = reference.forward(p, dropout_p=p.dropout_p, rows=(r0, r1))
        return out, lse

    outs, lses = [], []
    bounds = _bounds(p.Lq, rows)
    for i, (r0, r1) in enumerate(itertools.pairwise(bounds)):
        if i == 0:
            # Two rows first, kept for the backward rather than recomputed: a user mod made in
            # the compiled function decides how to call it on its first call, which changes a
            # Python object, and a checkpointed region may not. (Two: under vmap an axis of
            # one entry is a 0-d index, which dynamo cannot read without its value.)
            out, lse = chunk(r0, r1)
        else:
            out, lse = torch.utils.checkpoint.checkpoint(chunk, r0, r1, use_reentrant=False)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), (torch.cat(lses, dim=2) if p.return_lse else None)

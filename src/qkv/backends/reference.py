"""The reference backend: :mod:`qkv.reference` (the oracle) run as a backend."""

from __future__ import annotations

import torch

from .. import reference
from .._validate import Problem
from .base import Backend, score_bytes

Tensor = torch.Tensor


class ReferenceBackend(Backend):
    """Materialises the full score matrix; computes every problem; needs O(Lq·Lk) memory."""

    name = "reference"

    def rejects(self, p: Problem) -> str | None:
        return None

    def extra_memory(self, p: Problem) -> int:
        # scores, exp(scores) and weights live at once (plus a dropout copy when asked), and
        # autograd keeps about as much again for the backward.
        copies = 3 + (1 if p.dropout_p > 0 else 0)
        mask = 0 if p.mask is None or isinstance(p.mask, Tensor) else p.B * p.Hq * p.Lq * p.Lk
        return score_bytes(p, copies) + mask

    def run(self, p: Problem) -> tuple[Tensor, Tensor | None]:
        out, lse, _ = reference.forward(p, dropout_p=p.dropout_p)
        return out, (lse if p.return_lse else None)

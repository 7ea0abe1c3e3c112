from __future__ import annotations

import torch

from .._validate import Problem

Tensor = torch.Tensor


class Backend:
    """The interface every backend implements (see the package docstring)."""

    name: str = ""

    def rejects(self, p: Problem) -> str | None:
        """Why this backend cannot compute ``p`` exactly, or ``None`` if it can."""
        raise NotImplementedError

    def extra_memory(self, p: Problem) -> int:
        """Estimated peak bytes beyond the inputs and the output."""
        raise NotImplementedError

    def run(self, p: Problem) -> tuple[Tensor, Tensor | None]:
        """``out [B, Hq, Lq, Dv]`` and, when ``p.return_lse``, ``lse [B, Hq, Lq]`` float32."""
        raise NotImplementedError


def score_bytes(p: Problem, copies: int) -> int:
    """Bytes of ``copies`` dense ``[B, Hq, Lq, Lk]`` matrices in the compute dtype."""
    item = torch.finfo(p.compute_dtype).bits // 8
    return copies * p.B * p.Hq * p.Lq * p.Lk * item

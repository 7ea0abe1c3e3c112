"""The block-sparse engine's eager path behind one graph break, for the calls its custom
operator cannot take while dynamo traces (a user's score_mod beyond 2^20 scores, dropout)
and the plain formula cannot either (even its chunks of query rows would pass the dense limit,
or be too many to trace).

Its own module, imported only while dynamo traces: ``torch.compiler.disable`` imports dynamo,
which an ``import qkv`` must not (importing it before Triton's kernels are defined breaks
Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..._door import validate

Tensor = torch.Tensor

__all__ = ["eagerly"]


@torch.compiler.disable(
    reason="qkv: this call runs its block-sparse engine eagerly: a user's score_mod (code) "
    "beyond 2^20 scores cannot cross the engine's custom operator (nor can dropout), and the "
    "plain formula's scores pass the dense limit even in 256 chunks of query rows. "
    "fullgraph=True needs a built-in score (a bias tensor, qkv.alibi, qkv.softcap, "
    "qkv.relative_bias) or a higher qkv.set_dense_limit"
)
def eagerly(
    backend: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: object,
    score_mod: object,
    scale: float,
    dropout_p: float,
    return_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """``backend`` (the block-sparse one) planned and run eagerly (dynamo does not trace in)."""
    p = validate(q, k, v, mask=mask, score_mod=score_mod, scale=scale, dropout_p=dropout_p)
    p = replace(p, return_lse=return_lse)
    out: tuple[Tensor, Tensor | None] = backend.run(p, backend.route(p))
    return out

"""``qkv.MultiHeadAttention`` over a split sequence: ``mha(x_local, context_parallel=cp)``.

The module projects this rank's rows as usual; this file gives it the two things that change
when the sequence is split: the *global* positions of its rows (for RoPE) and the attention
call (``qd.attention`` instead of ``qkv.attention``). Masks and score_mods keep their global
meaning, so a model built from the module trains over a split sequence exactly as over the
whole one (gradients of its parameters are this rank's share: sum them over the ranks, as
data parallelism does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..typing import MaskLike, ScoreLike
from . import checks
from .api import attention
from .layout import Layout, check_layout, infer_length

Tensor = torch.Tensor


@dataclass(frozen=True)
class ContextParallel:
    """How ``qkv.MultiHeadAttention`` runs context-parallel: ``mha(x_local,
    context_parallel=qd.ContextParallel(group, layout="zigzag"))``. ``context_parallel=True``
    is the default group with the zigzag layout; a ``ProcessGroup`` is that group, zigzag."""

    group: Any = None
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        check_layout(self.layout)


class Bound:
    """One call's context-parallel view: ``positions [L_local]`` and ``attention(...)``."""

    def __init__(self, cp: ContextParallel, positions: Tensor) -> None:
        self.cp, self.positions = cp, positions

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: MaskLike = None,
        score_mod: ScoreLike = None,
        dropout_p: float = 0.0,
        return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        assert dropout_p == 0.0  # refused in bind()
        return attention(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            group=self.cp.group,
            layout=self.cp.layout,
            return_lse=return_lse,
        )


def bind(
    context_parallel: object,
    module: Any,
    x_local: Tensor,
    *,
    x_kv: object,
    cache: object,
    need_weights: bool,
) -> Bound:
    """Check a ``qkv.MultiHeadAttention`` call and find this rank's global positions (one
    ``all_gather`` of the ranks' lengths). ``x_local [B, L_local, d_model]``."""
    cross = x_kv is not None
    dropout = module.dropout if module.training else 0.0
    if context_parallel is True:
        cp = ContextParallel()
    elif isinstance(context_parallel, ContextParallel):
        cp = context_parallel
    elif isinstance(context_parallel, dist.ProcessGroup):
        cp = ContextParallel(context_parallel)
    else:
        raise TypeError(
            f"context_parallel must be True, a torch.distributed ProcessGroup or a "
            f"qkv.distributed.ContextParallel, got {type(context_parallel).__name__}"
        )
    for bad, why in (
        (cross, "cross-attention (x_kv): the context is not split"),
        (cache is not None, "a KV cache: decoding one token needs no split"),
        (need_weights, "need_weights: the full weights would not fit on one rank"),
        (dropout > 0.0, "attention dropout in training: qd.attention has none"),
    ):
        if bad:
            raise ValueError(f"context_parallel does not support {why}")
    rank, W = checks.check_group(cp.group)
    dev = x_local.device if dist.get_backend(cp.group) == "nccl" else torch.device("cpu")
    n = torch.tensor([x_local.shape[-2]], dtype=torch.int64, device=dev)
    ns = torch.empty(W, dtype=torch.int64, device=dev)
    checks.gather_into(ns, n, cp.group)
    lengths = [int(i) for i in ns.tolist()]
    L = infer_length(cp.layout, W, lengths)
    if L is None:
        raise ValueError(
            f"rank {rank}: x_local has shape {list(x_local.shape)}; the ranks' lengths "
            f"{lengths} are not the {cp.layout} layout of any sequence: split x with "
            f"qd.shard(x, layout={cp.layout!r}, dim=1)"
        )
    return Bound(cp, Layout(cp.layout, W, L).positions(rank).to(x_local.device))

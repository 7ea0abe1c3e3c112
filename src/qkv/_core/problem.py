"""One attention call as planners, backends and inspection read it: a :class:`Problem`,
its tensors as 4-D views and its mask and score classified (:mod:`qkv._core.kinds`). The door
that builds it from a call's arguments is :func:`qkv._door.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .evaluate import grid
from .kinds import MaskKind, ScoreKind

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class Problem:
    """One attention call, normalised to 4-D ``[B, H, L, D]`` views, its mask and score
    classified (:class:`qkv._core.kinds.MaskKind`, :class:`qkv._core.kinds.ScoreKind`)."""

    q: Tensor  # [B, Hq, Lq, D]
    k: Tensor  # [B, Hkv, Lk, D]
    v: Tensor  # [B, Hkv, Lk, Dv]
    mask: MaskKind
    score: ScoreKind
    scale: float
    dropout_p: float
    return_lse: bool
    orig_ndim: int
    # What the decision read from the tensors' values (the planner keeps the plan per answer):
    # "huge_logits", set by qkv.backends.base.imprecise_backward.
    reads: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def Hq(self) -> int:
        return self.q.shape[1]

    @property
    def Hkv(self) -> int:
        return self.k.shape[1]

    @property
    def Lq(self) -> int:
        return self.q.shape[2]

    @property
    def Lk(self) -> int:
        return self.k.shape[2]

    @property
    def D(self) -> int:
        return self.q.shape[3]

    @property
    def Dv(self) -> int:
        return self.v.shape[3]

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.Hq // self.Hkv

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """float64 stays float64; everything else accumulates in float32."""
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The full score shape ``[B, Hq, Lq, Lk]``."""
        return (self.B, self.Hq, self.Lq, self.Lk)

    def requires_grad(self) -> bool:
        """True when autograd will need a backward through this call."""
        if not torch.is_grad_enabled():
            return False
        tensors = [self.q, self.k, self.v]
        if self.score.bias is not None:
            tensors.append(self.score.bias)
        if any(t.requires_grad for t in tensors):
            return True
        # A callable score_mod may close over learnable tensors we cannot see.
        return self.score.is_callable

    def restore(self, t: Tensor) -> Tensor:
        """Undo the unbatched normalisation on any result whose leading dims are ``[B, Hq]``:
        ``out [1, 1, Lq, Dv]`` → ``[Lq, Dv]``, ``lse [1, Hq, Lq]`` → ``[Hq, Lq]``, weights, ..."""
        if self.orig_ndim == 2:
            return t[0, 0]  # [Lq, ...]
        if self.orig_ndim == 3:
            return t[0]  # [Hq, Lq, ...]
        return t

    def index_tensors(
        self, q_range: tuple[int, int] | None = None, kv_range: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Broadcastable int64 ``b [B,1,1,1]``, ``h [1,Hq,1,1]``, ``q_idx [1,1,Lq,1]``,
        ``kv_idx [1,1,1,Lk]`` (or the given sub-ranges), as mask_mods and score_mods get them."""
        q, kv = q_range or (0, self.Lq), kv_range or (0, self.Lk)
        return grid((0, self.B), (0, self.Hq), q, kv, self.device)

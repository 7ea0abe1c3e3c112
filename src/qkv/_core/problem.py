"""The door of every attention call: arguments checked and classified into one
:class:`Problem`.

``validate`` runs every check before any arithmetic and classifies the mask
and the score once (:mod:`qkv._core.kinds`); planners, backends and inspection read the problem's
typed fields and never look at what the user passed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._flex.blockmask import from_flex_block_mask
from .._flex.compat import adopt_mask, adopt_score_mod, is_flex_block_mask
from ..blockmask import BlockMask
from .checks import (
    check_bias_tensor,
    check_dropout,
    check_mask_tensor,
    check_qkv,
    check_scale,
)
from .evaluate import grid
from .kinds import MaskKind, ScoreKind, classify_mask, classify_score

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


def mask_kind(mask: object) -> MaskKind:
    """The kind of anything accepted as ``mask=`` (no check against a problem's shape)."""
    if isinstance(mask, BlockMask):  # a plan of a mask: it carries its kind
        return mask.kind
    return classify_mask(mask)


def _classify_mask(mask: object, q: Tensor, target: tuple[int, int, int, int]) -> MaskKind:
    if is_flex_block_mask(mask):  # FlexAttention's block lists and mask_mod, as qkv's
        mask = from_flex_block_mask(mask, *target, device=q.device)
    if isinstance(mask, BlockMask):
        mask.check_problem(*target)
        return mask.kind
    if isinstance(mask, Tensor):
        return classify_mask(check_mask_tensor(mask, q, target))
    mask = adopt_mask(mask, q.device, target)  # a mask_mod written for vmap is wrapped
    checker = getattr(mask, "_check_problem", None)
    if checker is not None:  # built-in masks know their own constraints
        checker(*target)
    return classify_mask(mask)


def _classify_score(score_mod: object, q: Tensor, target: tuple[int, int, int, int]) -> ScoreKind:
    if isinstance(score_mod, Tensor):
        return classify_score(check_bias_tensor(score_mod, q, target))
    # A score_mod written for vmap is wrapped: decided on its first call (once per function).
    score_mod = adopt_score_mod(score_mod, q.device)
    checker = getattr(score_mod, "_check_problem", None)
    if checker is not None:
        checker(*target)
    return classify_score(score_mod)


def validate(
    q: object,
    k: object,
    v: object,
    *,
    mask: object = None,
    score_mod: object = None,
    scale: object = None,
    dropout_p: object = 0.0,
    return_lse: object = False,
) -> Problem:
    """Check every argument of :func:`qkv.attention` and build the classified problem."""
    q4, k4, v4, orig = check_qkv(q, k, v)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {type(return_lse).__name__}")
    target = (q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2])
    return Problem(
        q=q4,
        k=k4,
        v=v4,
        mask=_classify_mask(mask, q4, target),
        score=_classify_score(score_mod, q4, target),
        scale=check_scale(scale, q4.shape[3]),
        dropout_p=check_dropout(dropout_p),
        return_lse=return_lse,
        orig_ndim=orig,
    )

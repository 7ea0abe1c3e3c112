"""The door of every attention call: arguments checked and classified into one
:class:`~qkv._core.problem.Problem`.

``validate`` runs every check before any arithmetic and classifies the mask and the score once
(:mod:`qkv._core.kinds`), after adopting what the layers above ``_core`` know: a FlexAttention
``BlockMask`` or a mod written for its vmap convention (:mod:`qkv._flex`) and a prebuilt
:class:`qkv.BlockMask`. Planners, backends and inspection read the problem's typed fields and
never look at what the user passed again.
"""

from __future__ import annotations

import torch

from ._core.checks import (
    InputTypeError,
    InputValueError,
    check_bias_tensor,
    check_dropout,
    check_mask_tensor,
    check_qkv,
    check_scale,
)
from ._core.kinds import MaskKind, ScoreKind, classify_mask, classify_score
from ._core.problem import Problem
from ._flex.blockmask import from_flex_block_mask
from ._flex.compat import adopt_mask, adopt_score_mod, is_flex_block_mask
from .blockmask import BlockMask

Tensor = torch.Tensor


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
    """Check every argument of :func:`qkv.attention` and build the classified problem. Bad
    input raises :class:`~qkv._core.checks.InputValueError` or ``InputTypeError``: ValueError
    or TypeError as qkv documents, and RuntimeError as torch's SDPA raises."""
    try:
        return _validate(q, k, v, mask, score_mod, scale, dropout_p, return_lse)
    except (ValueError, TypeError) as e:
        # The checks of what the door adopts (a mask's kind, a built-in mask's lengths, a
        # block mask's shape) raise plain ValueError / TypeError: the same message as both.
        kind = {ValueError: InputValueError, TypeError: InputTypeError}.get(type(e))
        if kind is None:  # ours already, or an exception class of the user's own
            raise
        raise kind(*e.args).with_traceback(e.__traceback__) from None


def _validate(
    q: object,
    k: object,
    v: object,
    mask: object,
    score_mod: object,
    scale: object,
    dropout_p: object,
    return_lse: object,
) -> Problem:
    q4, k4, v4, orig = check_qkv(q, k, v)
    if not isinstance(return_lse, bool):
        raise InputTypeError(f"return_lse must be True or False, got {type(return_lse).__name__}")
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

"""Classified masks and scores as plain values: a spec string with a list of tensors (for
custom operators), and tokens (for a call's signature).

A custom operator (``torch.library``) takes tensors and scalars only, so a call that crosses
one as a whole (the block-sparse engine under ``torch.compile``) carries its mask and score
as :func:`mask_spec` / :func:`score_spec` give them and rebuilds the same kinds on the other
side (:func:`mask_from_spec`, :func:`score_from_spec`). Each built-in class writes and reads
its own spec (:mod:`qkv._core.spec`); a user's mask_mod or score_mod, and anything holding
one, has no spec (``None``): it cannot cross an operator boundary.

The same masks and scores as *tokens* (:func:`mask_token`, :func:`score_token`): hashable
parts of a call's signature (``qkv._planning.signature``), under which the planner keeps the
call's decision.
"""

from __future__ import annotations

import weakref

import torch

from .builtin_mods import BuiltinMask
from .builtin_scores import BuiltinScore
from .kinds import MaskKind, ScoreKind, classify_mask, classify_score
from .spec import from_spec, slot
from .usermod import unwrapped
from .value import Value

Tensor = torch.Tensor

__all__ = [
    "Unwatched",
    "mask_from_spec",
    "mask_spec",
    "mask_token",
    "problem_mask_token",
    "score_from_spec",
    "score_spec",
    "score_token",
    "tensor_token",
    "unwatched",
    "value_token",
]


def mask_spec(m: MaskKind, tensors: list[Tensor]) -> str | None:
    """The spec of ``m``; its tensors are appended to ``tensors``. ``None`` when it holds a
    user's mask_mod."""
    mod = m.mask_mod
    return mod.spec(tensors) if isinstance(mod, BuiltinMask) else None


def score_spec(s: ScoreKind, tensors: list[Tensor]) -> str | None:
    """The spec of ``s``; its tensors are appended to ``tensors``. ``None`` for a user's
    score_mod."""
    if s.bias is not None:
        return f"bias({slot(s.bias, tensors)})"
    if s.score_mod is None:
        return "none"
    return s.score_mod.spec(tensors) if isinstance(s.score_mod, BuiltinScore) else None


def mask_from_spec(spec: str, tensors: list[Tensor]) -> MaskKind:
    """The kind :func:`mask_spec` described, with ``tensors`` in its slots."""
    return classify_mask(from_spec(spec, tensors))


def score_from_spec(spec: str, tensors: list[Tensor]) -> ScoreKind:
    """The kind :func:`score_spec` described, with ``tensors`` in its slots."""
    return classify_score(from_spec(spec, tensors))


# --------------------------------------------------------------------- signatures

_NONE = ()  # the token of no mask


class Unwatched(tuple[object, ...]):
    """The token of a mask whose values cannot be watched (a user's mask_mod and the tensors
    it closes over, a bool mask tensor, a block mask): its decision can be kept, but not a
    tile plan or a runner made from its values; backends plan its tiles on every call."""


def unwatched(m: MaskKind) -> bool:
    """True when ``m``'s tile plan reads values a signature does not watch (see
    :class:`Unwatched`): such a kept plan plans its tiles again at each call."""
    if m.block is not None or m.tensor is not None or m.is_user:
        return True
    return any(unwatched(part) for part in m.parts)


def problem_mask_token(m: MaskKind) -> object | None:
    """The token of a classified mask (see :func:`mask_token`)."""
    if m.block is not None:
        states = tensor_token(m.block.states)
        return None if states is None else Unwatched(("block", weakref.ref(m.block), states))
    if m.tensor is not None:  # any bool tensor of this shape is decided the same way
        return Unwatched(("tensor", tuple(m.tensor.shape), m.tensor.device))
    return mask_token(None if m.is_none else m.source)


def mask_token(mask: object) -> object | None:
    """A mask as part of a call's signature (``qkv._planning.signature``), or ``None`` when
    it cannot be one: a built-in mask (a :class:`~qkv._core.value.Value`) by its value
    (:func:`value_token`: its class, numbers and tensors' tokens, so one made anew at each call
    finds the last call's decision); a user's mask_mod weakly, as :class:`Unwatched`."""
    if mask is None:
        return _NONE
    if isinstance(mask, Value):
        return value_token(mask)
    if isinstance(mask, Tensor) or not callable(mask):
        return None  # (a bool tensor: problem_mask_token, once checked)
    return _mod_token(mask)


def _mod_token(mod: object) -> object | None:
    mod = unwrapped(mod)  # the door's wrapper of a user's mod: the mod is the key
    try:
        return Unwatched(("mod", weakref.ref(mod)))
    except TypeError:
        return None


def value_token(v: Value) -> object | None:
    """A built-in mask or score as a signature token: its class and parameters, each tensor
    by :func:`tensor_token` (identity, version, held weakly), each user mod among the parts of
    a combination as :class:`Unwatched`; ``None`` when a part has no token (an inference
    tensor, a callable that takes no weak reference)."""
    if v.plain:
        return v
    parts: list[object] = [type(v)]
    watched = True
    for x in v.params():
        if x is None or not (isinstance(x, (Tensor, Value)) or callable(x)):
            parts.append(x)  # a number, or None (an edge left open)
            continue
        t: object
        if isinstance(x, Tensor):
            t = tensor_token(x)
        elif isinstance(x, Value):
            t = value_token(x)
        else:
            t = _mod_token(x)
        if t is None:
            return None
        watched = watched and not isinstance(t, Unwatched)
        parts.append(t)
    return tuple(parts) if watched else Unwatched(parts)


def score_token(score: object) -> object | None:
    """A score as part of a call's signature: none; a bias tensor by its token; a built-in
    score_mod by its value (:func:`value_token`); a user's score_mod weakly (the decision reads
    its kind, never its values or the tensors it closes over: each call's problem is bound
    when it runs). ``None`` for a callable that takes no weak reference."""
    if score is None:
        return _NONE
    if isinstance(score, Tensor):
        token = tensor_token(score)
        return None if token is None else ("bias", token)
    if isinstance(score, Value):
        return value_token(score)
    score = unwrapped(score)  # the door's wrapper of a user's mod: the mod is the key
    try:
        return weakref.ref(score)
    except TypeError:
        return None


def tensor_token(t: Tensor) -> tuple[object, ...] | None:
    """``(identity, version counter, weak reference)``: equal only for the same living tensor
    unedited since. The identity comes first, so tokens of different tensors never compare
    the tensors themselves. ``None`` for an inference tensor (it has no version counter)."""
    try:
        return (id(t), t._version, weakref.ref(t))
    except RuntimeError:  # an inference tensor
        return None

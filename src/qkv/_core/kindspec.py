"""Classified masks and scores as plain values: a spec string and a list of tensors.

A custom operator (``torch.library``) takes tensors and scalars only, so a call that crosses
one as a whole (the block-sparse engine under ``torch.compile``) carries its mask and score
as :func:`mask_spec` / :func:`score_spec` give them and rebuilds the same kinds on the other
side (:func:`mask_from_spec`, :func:`score_from_spec`)::

    and_masks(causal, document(ids))   -> "and(causal;doc(#0))", [ids]
    sliding_window(4)                  -> "band(-4,0)", []
    alibi(slopes)                      -> "alibi(#0)", [slopes]

The spec holds the structure and the numbers that decide it (band edges, a prefix length, a
softcap), which dynamo guards on like any constant it reads (under ``dynamic=True`` those
numbers are symbolic: each travels as a 0-d tensor in a slot marked ``@``); the tensors
(document ids, padding lengths, bool masks, biases, ALiBi slopes, relative tables) travel as
graph inputs, so new values of the same shapes reuse the compiled graph. A user's mask_mod or
score_mod, and anything holding one, has no spec (``None``): it cannot cross an operator
boundary.

The same masks and scores as *tokens* (:func:`mask_token`, :func:`score_token`): hashable
parts of a call's signature (``qkv._planning.signature``), under which the planner keeps the
call's decision.
"""

from __future__ import annotations

import weakref

import torch

from .._flex.compat import ModCall
from .builtin_mods import (
    CAUSAL,
    Alibi,
    And,
    Document,
    KvBelow,
    Or,
    RelativeBias,
    Softcap,
)
from .kinds import NO_MASK, NO_SCORE, MaskKind, ScoreKind, band, classify_mask, classify_score
from .tracing import is_symbolic
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


def _slot(t: Tensor, tensors: list[Tensor]) -> str:
    tensors.append(t)
    return f"#{len(tensors) - 1}"


def _number(x: float | None, tensors: list[Tensor]) -> str:
    """A number of a spec (a band edge, a prefix or padding length, a distance, a softcap)
    written out. A symbolic one (dynamo traces with ``dynamic=True``; a spec must be a
    constant) travels as a 0-d tensor in a slot marked ``@``, read back in the operator."""
    if x is None:
        return "-"
    if not is_symbolic(x):
        return repr(x)
    dtype = torch.float64 if isinstance(x, float) else torch.int64
    tensors.append(torch.scalar_tensor(x, dtype=dtype))
    return f"@{len(tensors) - 1}"


def has_numbers(spec: str) -> bool:
    """Whether ``spec`` holds ints in slots (see :func:`_number`): it then says less than the
    kind it describes, whose ints are read from its tensors."""
    return "@" in spec


def mask_spec(m: MaskKind, tensors: list[Tensor]) -> str | None:
    """The spec of ``m``; its tensors are appended to ``tensors``. ``None`` when it holds a
    user's mask_mod."""
    if m.kind == "none":
        return "none"
    if m.kind == "causal":
        return "causal"
    if m.kind == "band":
        return f"band({_number(m.lo, tensors)},{_number(m.hi, tensors)})"
    if m.kind == "prefix":
        return f"prefix({_number(m.limit, tensors)})" if isinstance(m.limit, int) else None
    if m.kind == "document" and m.ids is not None:
        return f"doc({_slot(m.ids, tensors)})"
    if m.kind == "padding":
        lim = (
            _number(m.limit, tensors) if isinstance(m.limit, int) else _slot(m.limit, tensors)  # type: ignore[arg-type]
        )
        start = "-" if m.start is None else _slot(m.start, tensors)
        return f"pad({lim},{start})"
    if m.kind == "tensor" and m.tensor is not None:
        return f"tensor({_slot(m.tensor, tensors)})"
    if m.kind in ("and", "or"):
        parts = [mask_spec(p, tensors) for p in m.parts]
        if any(s is None for s in parts):
            return None
        return f"{m.kind}({';'.join(parts)})"  # type: ignore[arg-type]
    return None  # "mod": a user's mask_mod


def score_spec(s: ScoreKind, tensors: list[Tensor]) -> str | None:
    """The spec of ``s``; its tensors are appended to ``tensors``. ``None`` for a user's
    score_mod."""
    src = s.source
    if s.kind == "none":
        return "none"
    if s.kind == "bias" and s.bias is not None:
        return f"bias({_slot(s.bias, tensors)})"
    if s.kind == "alibi" and isinstance(src, Alibi):
        return f"alibi({_slot(src.slopes, tensors)})"
    if s.kind == "softcap" and isinstance(src, Softcap):
        return f"softcap({_number(src.cap, tensors)})"
    if s.kind == "relative" and isinstance(src, RelativeBias):
        return f"relative({_slot(src.table, tensors)},{_number(src.max_distance, tensors)})"
    return None


# ------------------------------------------------------------------------------ rebuilding


def _split(args: str) -> list[str]:
    """Top-level ``;``-separated parts of ``args`` (parentheses nest)."""
    parts, depth, at = [], 0, 0
    for i, c in enumerate(args):
        depth += (c == "(") - (c == ")")
        if c == ";" and depth == 0:
            parts.append(args[at:i])
            at = i + 1
    return [*parts, args[at:]]


def _parse(spec: str) -> tuple[str, str]:
    name, _, rest = spec.partition("(")
    return name, rest[:-1] if rest else ""


def _value(x: str, tensors: list[Tensor]) -> Tensor | int | None:
    if x == "-":
        return None
    if x.startswith("@"):  # a number in a slot
        return tensors[int(x[1:])].item()  # type: ignore[return-value]
    return tensors[int(x[1:])] if x.startswith("#") else int(x)


def mask_from_spec(spec: str, tensors: list[Tensor]) -> MaskKind:
    """The kind :func:`mask_spec` described, with ``tensors`` in its slots."""
    name, args = _parse(spec)
    if name == "none":
        return NO_MASK
    if name == "causal":
        return classify_mask(CAUSAL)
    if name == "band":
        lo, hi = (_value(a, tensors) for a in args.split(","))
        return band(lo, hi)  # type: ignore[arg-type]
    if name == "prefix":
        P = _value(args, tensors)
        assert isinstance(P, int)
        mod = Or((KvBelow(P, f"kv_idx < {P}"), CAUSAL), f"qkv.prefix_lm({P})")
        return MaskKind("prefix", mod, limit=P)
    if name == "doc":
        return classify_mask(Document(tensors[int(args[1:])]))
    if name == "pad":
        lim, start = (_value(a, tensors) for a in args.split(","))
        obj = KvBelow(lim, "padding", start)  # type: ignore[arg-type]
        return MaskKind("padding", obj, source=obj, limit=lim, start=start)  # type: ignore[arg-type]
    if name == "tensor":
        return classify_mask(tensors[int(args[1:])])
    if name in ("and", "or"):
        parts = tuple(mask_from_spec(a, tensors) for a in _split(args))
        mods = tuple(p.mask_mod for p in parts)
        joined: And | Or = And(mods, spec) if name == "and" else Or(mods, spec)
        return MaskKind(name, joined, source=joined, parts=parts)
    raise ValueError(f"not a mask spec: {spec!r}")


def score_from_spec(spec: str, tensors: list[Tensor]) -> ScoreKind:
    """The kind :func:`score_spec` described, with ``tensors`` in its slots."""
    name, args = _parse(spec)
    if name == "none":
        return NO_SCORE
    if name == "bias":
        return classify_score(tensors[int(args[1:])])
    if name == "alibi":
        return classify_score(Alibi(tensors[int(args[1:])]))
    if name == "softcap":
        cap = float(tensors[int(args[1:])].item() if args.startswith("@") else args)
        return classify_score(Softcap(cap))
    if name == "relative":
        t, r = args.split(",")
        return classify_score(RelativeBias(tensors[int(t[1:])], _value(r, tensors)))  # type: ignore[arg-type]
    raise ValueError(f"not a score spec: {spec!r}")


# --------------------------------------------------------------------- signatures

_NONE = ()  # the token of no mask


class Unwatched(tuple[object, ...]):
    """The token of a mask whose values cannot be watched (a user's mask_mod and the tensors
    it closes over, a bool mask tensor, a block mask): its decision can be kept, but not a
    tile plan or a runner made from its values; backends plan its tiles on every call."""


def unwatched(m: MaskKind) -> bool:
    """True when ``m``'s tile plan reads values a signature does not watch (see
    :class:`Unwatched`): such a kept plan plans its tiles again at each call."""
    if m.block is not None or m.kind in ("mod", "tensor"):
        return True
    return any(unwatched(part) for part in m.parts)


def problem_mask_token(m: MaskKind) -> object | None:
    """The token of a classified mask (see :func:`mask_token`)."""
    if m.block is not None:
        states = tensor_token(m.block.states)
        return None if states is None else Unwatched(("block", weakref.ref(m.block), states))
    if m.tensor is not None:  # any bool tensor of this shape is decided the same way
        return Unwatched(("tensor", tuple(m.tensor.shape), m.tensor.device))
    return mask_token(m.source if m.kind != "none" else None)


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
    if isinstance(mod, ModCall):  # the door's wrapper of a user's mod: the mod is the key
        mod = mod.fn
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
    if isinstance(score, ModCall):  # the door's wrapper of a user's mod: the mod is the key
        score = score.fn
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

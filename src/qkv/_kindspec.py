"""Classified masks and scores as plain values: a spec string and a list of tensors.

A custom operator (``torch.library``) takes tensors and scalars only, so a call that crosses
one as a whole (the block-sparse engine under ``torch.compile``) carries its mask and score
as :func:`mask_spec` / :func:`score_spec` give them and rebuilds the same kinds on the other
side (:func:`mask_from_spec`, :func:`score_from_spec`)::

    and_masks(causal, document(ids))   -> "and(causal;doc(#0))", [ids]
    sliding_window(4)                  -> "band(-4,0)", []
    alibi(slopes)                      -> "alibi(#0)", [slopes]

The spec holds the structure and the numbers that decide it (band edges, a prefix length, a
softcap), which dynamo guards on like any constant it reads; the tensors (document ids,
padding lengths, bool masks, biases, ALiBi slopes, relative tables) travel as graph inputs,
so new values of the same shapes reuse the compiled graph. A user's mask_mod or score_mod,
and anything holding one, has no spec (``None``): it cannot cross an operator boundary.
"""

from __future__ import annotations

import torch

from ._kinds import NO_MASK, NO_SCORE, MaskKind, ScoreKind, band, classify_mask, classify_score
from .masks import _And, _Document, _KvBelow, _Or, causal
from .scores import _Alibi, _RelativeBias, _Softcap

Tensor = torch.Tensor

__all__ = ["mask_from_spec", "mask_spec", "score_from_spec", "score_spec"]


def _slot(t: Tensor, tensors: list[Tensor]) -> str:
    tensors.append(t)
    return f"#{len(tensors) - 1}"


def _edge(x: int | None) -> str:
    return "-" if x is None else str(x)


def mask_spec(m: MaskKind, tensors: list[Tensor]) -> str | None:
    """The spec of ``m``; its tensors are appended to ``tensors``. ``None`` when it holds a
    user's mask_mod."""
    if m.kind == "none":
        return "none"
    if m.kind == "causal":
        return "causal"
    if m.kind == "band":
        return f"band({_edge(m.lo)},{_edge(m.hi)})"
    if m.kind == "prefix":
        return f"prefix({m.limit})" if isinstance(m.limit, int) else None
    if m.kind == "document" and m.ids is not None:
        return f"doc({_slot(m.ids, tensors)})"
    if m.kind == "padding":
        lim = m.limit if isinstance(m.limit, int) else _slot(m.limit, tensors)  # type: ignore[arg-type]
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
    if s.kind == "alibi" and isinstance(src, _Alibi):
        return f"alibi({_slot(src.slopes, tensors)})"
    if s.kind == "softcap" and isinstance(src, _Softcap):
        return f"softcap({src.cap!r})"
    if s.kind == "relative" and isinstance(src, _RelativeBias):
        return f"relative({_slot(src.table, tensors)},{src.max_distance})"
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
    return tensors[int(x[1:])] if x.startswith("#") else int(x)


def mask_from_spec(spec: str, tensors: list[Tensor]) -> MaskKind:
    """The kind :func:`mask_spec` described, with ``tensors`` in its slots."""
    name, args = _parse(spec)
    if name == "none":
        return NO_MASK
    if name == "causal":
        return classify_mask(causal)
    if name == "band":
        lo, hi = (_value(a, tensors) for a in args.split(","))
        return band(lo, hi)  # type: ignore[arg-type]
    if name == "prefix":
        P = int(args)
        mod = _Or((_KvBelow(P, f"kv_idx < {P}"), causal), f"qkv.prefix_lm({P})")
        return MaskKind("prefix", mod, limit=P)
    if name == "doc":
        return classify_mask(_Document(tensors[int(args[1:])]))
    if name == "pad":
        lim, start = (_value(a, tensors) for a in args.split(","))
        obj = _KvBelow(lim, "padding", start)  # type: ignore[arg-type]
        return MaskKind("padding", obj, source=obj, limit=lim, start=start)  # type: ignore[arg-type]
    if name == "tensor":
        return classify_mask(tensors[int(args[1:])])
    if name in ("and", "or"):
        parts = tuple(mask_from_spec(a, tensors) for a in _split(args))
        mods = tuple(p.mask_mod for p in parts)
        joined: _And | _Or = _And(mods, spec) if name == "and" else _Or(mods, spec)
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
        return classify_score(_Alibi(tensors[int(args[1:])]))
    if name == "softcap":
        return classify_score(_Softcap(float(args)))
    if name == "relative":
        t, r = args.split(",")
        return classify_score(_RelativeBias(tensors[int(t[1:])], int(r)))
    raise ValueError(f"not a score spec: {spec!r}")

"""Spec strings: how a built-in mask or score writes itself for a custom operator.

A custom operator (``torch.library``) takes tensors and scalars only, so a call that crosses
one as a whole (the block-sparse engine under ``torch.compile``) carries its mask and score as
a string and a list of tensors, and rebuilds the same values on the other side. Each built-in
class writes its own spec (``spec(tensors)``) and reads it back (``from_spec(args, tensors)``),
registered here under its spec name by :func:`registered`::

    and_masks(causal, document(ids))   -> "and(causal;doc(#0))", [ids]
    sliding_window(4)                  -> "band(-4,0)", []
    alibi(slopes)                      -> "alibi(#0)", [slopes]

A spec holds the structure and the numbers that decide it (band edges, a prefix length, a
softcap), which dynamo guards on like any constant it reads (under ``dynamic=True`` those
numbers are symbolic: each travels as a 0-d tensor in a slot marked ``@``); the tensors travel
as graph inputs (slots marked ``#``), so new values of the same shapes reuse the graph.
"""

from __future__ import annotations

from typing import Any

import torch

from .tracing import is_symbolic

Tensor = torch.Tensor

# spec name -> the class that reads it back (``cls.from_spec(args, tensors)``)
READERS: dict[str, Any] = {}


def registered(*names: str) -> Any:
    """Class decorator: ``cls`` reads the specs named ``names`` back."""

    def register(cls: Any) -> Any:
        for name in names:
            READERS[name] = cls
        return cls

    return register


def slot(t: Tensor, tensors: list[Tensor]) -> str:
    """``t`` as a graph input: appended to ``tensors``, written as its slot ``#i``."""
    tensors.append(t)
    return f"#{len(tensors) - 1}"


def number(x: float | None, tensors: list[Tensor]) -> str:
    """A number written out; ``-`` for ``None`` (an edge left open). A symbolic one (dynamo
    traces with ``dynamic=True``; a spec must be a constant) travels as a 0-d tensor in a slot
    marked ``@``, read back in the operator."""
    if x is None:
        return "-"
    if not is_symbolic(x):
        return repr(x)
    dtype = torch.float64 if isinstance(x, float) else torch.int64
    tensors.append(torch.scalar_tensor(x, dtype=dtype))
    return f"@{len(tensors) - 1}"


def has_numbers(spec: str) -> bool:
    """Whether ``spec`` holds numbers in slots (see :func:`number`): it then says less than
    the value it describes, whose numbers are read from its tensors."""
    return "@" in spec


def holds_tensors(spec: str) -> bool:
    """Whether ``spec`` reads tensors (document ids, lengths, a bool mask, slopes): without
    them the spec is the whole structure of the value."""
    return "#" in spec


def read(x: str, tensors: list[Tensor]) -> Any:
    """One argument back: ``None``, a number (written or in a slot) or a tensor."""
    if x == "-":
        return None
    if x.startswith("@"):  # a number in a slot
        return tensors[int(x[1:])].item()
    if x.startswith("#"):
        return tensors[int(x[1:])]
    return float(x) if "." in x or "e" in x or "inf" in x else int(x)


def split(args: str) -> list[str]:
    """Top-level ``;``-separated parts of ``args`` (parentheses nest)."""
    parts, depth, at = [], 0, 0
    for i, c in enumerate(args):
        depth += (c == "(") - (c == ")")
        if c == ";" and depth == 0:
            parts.append(args[at:i])
            at = i + 1
    return [*parts, args[at:]]


def from_spec(spec: str, tensors: list[Tensor]) -> Any:
    """The built-in value a class's ``spec`` wrote (a mask, a score, or ``None`` for none)."""
    name, _, rest = spec.partition("(")
    cls = READERS.get(name)
    if cls is None:
        raise ValueError(f"not a mask or score spec: {spec!r}")
    return cls.from_spec(rest[:-1] if rest else "", tensors)

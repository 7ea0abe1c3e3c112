"""Built-in mask_mods: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` with True = may attend.

This is FlexAttention's convention, so FlexAttention mask_mods work in qkv unchanged and these
work in FlexAttention. qkv calls a mask_mod once per block with broadcastable int64 index
tensors (``b [B,1,1,1]``, ``h [1,H,1,1]``, ``q_idx [1,1,Lq,1]``, ``kv_idx [1,1,1,Lk]``), never
per element, so any mask built from comparisons, indexing, ``&``, ``|``, ``~`` and
``torch.where`` works without vmap or compile.

The built-ins are small objects rather than plain functions (:mod:`qkv._core.builtin_mods`):
values (equal when made with equal parameters: ``sliding_window(8) == sliding_window(8)``, so
one written inside ``forward`` finds the decision its last call kept) that also carry their
structure (a band of diagonals, a prefix of keys, equal document ids) and their tile rule, so
the tile planner (:mod:`qkv._core.tiles`) classifies blocks as empty, full or partial without
evaluating n² positions, and combinations reach the kernel of the mask they equal.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ._core.builtin_mods import CAUSAL, Band, Document, KvBelow, Prefix
from ._core.checks import callable_name
from ._core.combinations import And, Or
from ._core.lru import LRU

Tensor = torch.Tensor
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

__all__ = [
    "and_masks",
    "causal",
    "document",
    "or_masks",
    "padding",
    "prefix_lm",
    "sliding_window",
]


causal: MaskMod = CAUSAL
causal.__doc__ = """Causal mask: ``q_idx >= kv_idx``, aligned top-left.

This is ``is_causal=True`` in ``torch.nn.functional.scaled_dot_product_attention``: query ``i``
sees keys ``0..i`` whatever the lengths. For ``Lq=3, Lk=5`` (rows are queries)::

    1 0 0 0 0
    1 1 0 0 0
    1 1 1 0 0

For decoding with a KV cache, where queries are the *last* ``Lq`` positions of ``Lk``, shift the
query index (``qkv.MultiHeadAttention`` does that for you). Called with ``q_idx [1, 1, Lq, 1]``
and ``kv_idx [1, 1, 1, Lk]`` it gives a bool ``[1, 1, Lq, Lk]``.
"""


def sliding_window(left: int, right: int = 0) -> MaskMod:
    """Attend iff ``q_idx - left <= kv_idx <= q_idx + right``.

    ``left`` keys before the query and ``right`` keys after it (plus the query's own position).
    ``sliding_window(2)`` on ``Lq = Lk = 5`` (a causal window of 3 keys)::

        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0
        0 1 1 1 0
        0 0 1 1 1

    ``sliding_window(1, 1)`` is a symmetric band of width 3.

    Returns a mask_mod: called with ``q_idx [1, 1, Lq, 1]`` and ``kv_idx [1, 1, 1, Lk]`` (see
    :data:`qkv.typing.MaskMod`) it gives a bool tensor broadcastable to ``[B, H, Lq, Lk]``.
    """
    for name, val in (("left", left), ("right", right)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"sliding_window {name} must be an int, got {type(val).__name__}")
        if val < 0:
            raise ValueError(
                f"sliding_window {name} must be >= 0, got {val}; it counts keys on that side "
                f"of the query"
            )
    name = f"qkv.sliding_window({left})" if right == 0 else f"qkv.sliding_window({left}, {right})"
    return Band(-left, right, name)


def padding(lengths: Tensor, *, start: Tensor | None = None) -> MaskMod:
    """Key padding: attend iff ``start[b] <= kv_idx < start[b] + lengths[b]``.

    ``lengths`` is a 1-D integer tensor with one valid key count per batch element; ``start``
    (default 0: right padding) the first valid key of each, for left-padded rows. For
    ``lengths = [3, 5]`` and ``Lk = 5``, every query row of batch 0 is ``1 1 1 0 0`` and of
    batch 1 is ``1 1 1 1 1``; with ``start = [2, 0]`` batch 0 is ``0 0 1 1 1``. A length of 0
    masks every key: those rows give output 0. The planner skips the key blocks outside each
    row's range without evaluating any position.

    Args:
        lengths: ``[B]`` integer tensor, valid keys per batch element.
        start: ``[B]`` integer tensor or ``None`` (0), the first valid key of each.

    Returns a mask_mod giving a bool ``[B, 1, 1, Lk]`` (broadcast over heads and queries).
    """
    _check_counts("padding lengths", lengths)
    if start is None:
        return KvBelow(lengths, None, given=(lengths, None))  # (integers: no gradient)
    _check_counts("padding start", start)
    if start.shape != lengths.shape:
        raise ValueError(
            f"padding start has shape {tuple(start.shape)} but lengths has "
            f"{tuple(lengths.shape)}; give one start per batch element"
        )
    end = (start.to(torch.int64) + lengths.to(torch.int64)).detach()
    return KvBelow(end, None, start.detach().to(torch.int64), given=(lengths, start))


def _check_counts(what: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{what} must be a 1-D integer tensor, got {type(t).__name__}; use torch.tensor([...])"
        )
    if t.ndim != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(
            f"{what} must be a 1-D integer tensor [B], got shape "
            f"{tuple(t.shape)} and dtype {t.dtype}"
        )
    if torch.compiler.is_compiling():
        # a value check would break the graph: checked when the graph runs instead
        torch._assert_async((t >= 0).all(), f"{what} must be >= 0")
        return
    if _checked_before(t):
        return
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{what} must be >= 0, got {t.tolist()}")
    if not t.is_inference():  # (no version counter to tell an edit)
        _CHECKED.put(id(t), (weakref.ref(t), t._version))


# Counts checked already, unedited since (a mask made in every forward from the same lengths
# reads them once, not at every call: the read costs a few us beside a small call's ~100).
_CHECKED: LRU[int, tuple[weakref.ref[Tensor], int]] = LRU(64)


def _checked_before(t: Tensor) -> bool:
    got = _CHECKED.get(id(t))
    return got is not None and got[0]() is t and not t.is_inference() and got[1] == t._version


def document(ids: Tensor) -> MaskMod:
    """Document (packed-sequence) mask: attend iff ``ids[q_idx] == ids[kv_idx]``, or
    ``ids[b, q_idx] == ids[b, kv_idx]`` with one row of ids per batch element.

    ``ids`` gives each position's document, covering both lengths. For ``ids = [0, 0, 1, 1, 1]``::

        1 1 0 0 0
        1 1 0 0 0
        0 0 1 1 1
        0 0 1 1 1
        0 0 1 1 1

    In training each batch row is packed differently: give ``ids`` as ``[B, L]``, row ``b``
    the documents of batch element ``b``. For ``ids = [[0, 0, 1, 1], [0, 1, 1, 1]]`` batch 0
    sees the first grid below and batch 1 the second::

        1 1 0 0      1 0 0 0
        1 1 0 0      0 1 1 1
        0 0 1 1      0 1 1 1
        0 0 1 1      0 1 1 1

    Combine with causal for packed causal training: ``and_masks(causal, document(ids))``.
    Sorted ids (each document one run of positions) are the fast case: every kernel skips
    the other documents' keys; unsorted ids are exact too.

    Args:
        ids: integer tensor ``[L]`` (or ``[1, L]``), one packing shared by every batch
            element, or ``[B, L]``, one per batch element; ``L >= max(Lq, Lk)``.

    Returns a mask_mod giving a bool ``[1, 1, Lq, Lk]`` (``[B, 1, Lq, Lk]`` for ``[B, L]``
    ids); equivalent to ``qkv.reference.attention`` with that mask as a bool tensor.
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"document ids must be an integer tensor [L] or [B, L], got {type(ids).__name__}; "
            f"use torch.tensor([...])"
        )
    if ids.ndim not in (1, 2) or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise ValueError(
            f"document ids must be an integer tensor [L] (one packing for every batch "
            f"element) or [B, L] (one row per batch element), got shape {tuple(ids.shape)} "
            f"and dtype {ids.dtype}"
            + (
                "; for ids of several batch dims, flatten them into the batch: "
                "ids.reshape(-1, ids.shape[-1])"
                if ids.ndim > 2
                else ""
            )
        )
    return Document(ids)  # (integer ids never need a gradient: kept as given, the value)


def prefix_lm(n: int) -> MaskMod:
    """Prefix-LM mask: attend iff ``kv_idx < n`` or ``q_idx >= kv_idx``.

    The first ``n`` keys (the prefix) are visible to every query; the rest is causal.
    ``prefix_lm(2)`` on ``Lq = Lk = 4``::

        1 1 0 0
        1 1 0 0
        1 1 1 0
        1 1 1 1

    Returns a mask_mod: called with ``q_idx [1, 1, Lq, 1]`` and ``kv_idx [1, 1, 1, Lk]`` (see
    :data:`qkv.typing.MaskMod`) it gives a bool tensor broadcastable to ``[B, H, Lq, Lk]``.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"prefix_lm length must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"prefix_lm length must be >= 0, got {n}")
    return Prefix(n)


def _check_mods(kind: str, mods: tuple[Any, ...]) -> None:
    if not mods:
        raise ValueError(f"{kind} needs at least one mask_mod")
    for i, m in enumerate(mods):
        if isinstance(m, torch.Tensor) or not callable(m):
            raise TypeError(
                f"{kind} argument {i} is a {type(m).__name__}; it combines mask_mod callables "
                f"(b, h, q_idx, kv_idx) -> bool. Wrap a bool tensor t as "
                f"lambda b, h, q, k: t[q, k]"
            )


def and_masks(*mods: MaskMod) -> MaskMod:
    """Attend where *every* mask_mod allows: ``and_masks(causal, document(ids))``.

    The result is a mask_mod whose bool result is the ``&`` of theirs, broadcast to
    ``[B, H, Lq, Lk]`` (each mod's may be any broadcastable shape).
    """
    _check_mods("and_masks", mods)
    name = "qkv.and_masks(" + ", ".join(callable_name(m) for m in mods) + ")"
    return And(mods, name)


def or_masks(*mods: MaskMod) -> MaskMod:
    """Attend where *any* mask_mod allows: ``or_masks(sliding_window(64), global_tokens)``.

    The result is a mask_mod whose bool result is the ``|`` of theirs, broadcast to
    ``[B, H, Lq, Lk]`` (each mod's may be any broadcastable shape).
    """
    _check_mods("or_masks", mods)
    name = "qkv.or_masks(" + ", ".join(callable_name(m) for m in mods) + ")"
    return Or(mods, name)

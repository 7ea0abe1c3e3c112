"""Masks and scores classified once, at the door.

:func:`classify_mask` turns whatever was passed as ``mask=`` into one :class:`MaskKind` and
:func:`classify_score` turns ``score_mod=`` into one :class:`ScoreKind`. Every later layer
(tile planning, backend choice, kernels, inspection, the KV-cache shift) reads the kind's tag
and fields. The built-in classes (:mod:`qkv._core.builtin_mods`) are known here and in
:mod:`qkv._core.kindspec` (which rebuilds kinds from specs and makes the tokens of a call's
signature).

Combinations of built-ins are simplified to the kind they are, so that they reach the same
kernels as the mask they equal::

    and_masks(causal, sliding_window(w))       -> band [-w, 0]   (= sliding_window(w))
    and_masks(sliding_window(8), window(3, 2)) -> band [-3, 0]   (bands intersect)
    or_masks(sliding_window(4), band [-9, -3]) -> band [-9, 0]   (overlapping bands unite)
    or_masks(kv_idx < P, causal)               -> prefix P       (= prefix_lm(P))
    and_masks(m) / or_masks(m)                 -> m

Each kind keeps an always-callable ``mask_mod`` (FlexAttention's convention, called with
broadcastable index tensors) for the paths that evaluate positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._flex.compat import ModCall
from .builtin_mods import (
    CAUSAL,
    Alibi,
    And,
    Band,
    BuiltinMask,
    Document,
    KvBelow,
    Or,
    RelativeBias,
    Softcap,
)
from .checks import callable_name
from .grid import FULL, Grid

Tensor = torch.Tensor

MASK_KINDS = (
    "none",
    "causal",
    "band",
    "prefix",
    "document",
    "padding",
    "and",
    "or",
    "tensor",
    "mod",
)
SCORE_KINDS = ("none", "bias", "alibi", "softcap", "relative", "mod")


class _AllTrue(BuiltinMask):
    """The mask_mod of "no mask": every position may attend."""

    plain = True

    def params(self) -> tuple[object, ...]:
        return ()

    def tile_states(self, g: Grid) -> Tensor:
        return torch.full((1, 1, g.nq, g.nk), FULL, dtype=torch.int8)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        shape = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        return torch.ones((), dtype=torch.bool, device=q_idx.device).expand(shape)

    __name__ = "no mask"

    def __repr__(self) -> str:
        return "none"


class _TensorMaskMod:
    """A bool tensor ``[B|1, H|1, Lq|1, Lk|1]`` seen as a mask_mod."""

    def __init__(self, t: Tensor) -> None:
        self.t = t

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        idx = [
            i if n > 1 else torch.zeros_like(i)
            for i, n in zip((b, h, q_idx, kv_idx), self.t.shape, strict=True)
        ]
        return self.t[idx[0], idx[1], idx[2], idx[3]]

    @property
    def __name__(self) -> str:
        return f"bool tensor {list(self.t.shape)}"

    def __repr__(self) -> str:
        return self.__name__


@dataclass(frozen=True, eq=False)
class MaskKind:
    """One mask, classified. ``kind`` is one of :data:`MASK_KINDS`; the fields that kind
    uses are set, the others keep their defaults.

    - ``causal`` / ``band``: attend iff ``lo <= kv_idx - q_idx <= hi`` (``None`` = unbounded;
      causal is ``lo=None, hi=0``).
    - ``prefix``: ``kv_idx < limit`` or causal (``limit`` an int).
    - ``padding``: ``start <= kv_idx < limit`` (``limit`` an int or a ``[B]`` tensor of
      ends, ``start`` ``None`` = 0 or a ``[B]`` tensor).
    - ``document``: ``ids[q_idx] == ids[kv_idx]``.
    - ``and`` / ``or``: ``parts``, each a simplified kind (no nested and-in-and).
    - ``tensor``: ``tensor``, a 4-D bool tensor broadcastable to ``[B, Hq, Lq, Lk]``.
    - ``mod``: a user mask_mod, evaluated position by position through ``mask_mod``;
      ``evaluation`` says how (``"broadcast"``, or ``"vmap"`` for mods written for vmap).

    ``block`` is a prebuilt :class:`qkv.BlockMask` of this same mask (its tile plan), when one
    was passed: it is a plan of a mask rather than a kind of its own, so every layer reads the
    structure it was built from directly.
    """

    kind: str
    mask_mod: Callable[..., Any]
    source: object = None  # what was passed (names it in plans and errors)
    lo: int | None = None
    hi: int | None = None
    limit: int | Tensor | None = None
    start: Tensor | None = None  # padding: the first valid key of each batch element
    ids: Tensor | None = None
    parts: tuple[MaskKind, ...] = ()
    tensor: Tensor | None = None
    block: Any = None  # qkv.BlockMask | None (blockmask.py imports this module)
    evaluation: str = "broadcast"
    simplified: bool = False  # True when a combination was reduced to a simpler kind

    @property
    def name(self) -> str:
        """How plans and errors name the mask (``qkv.causal``, ``bool tensor [1, 1, 7, 9]``)."""
        src = self.source if self.source is not None else self.mask_mod
        base, simple = describe(src), describe(self.mask_mod)
        return f"{base} = {simple}" if self.simplified and simple != base else base

    @property
    def given(self) -> object:
        """What was passed as ``mask=`` (a bool tensor right-aligned to 4 dims)."""
        if self.block is not None:
            return self.block
        return None if self.kind == "none" and self.source is None else self.source

    @property
    def is_band(self) -> bool:
        return self.kind in ("causal", "band")

    def with_block(self, bm: Any) -> MaskKind:
        return replace(self, block=bm)

    def document_causal(self) -> tuple[Tensor, bool] | None:
        """``(ids, causal)`` for ``document(ids)`` or ``and_masks(causal, document(ids))``."""
        if self.kind == "document":
            assert self.ids is not None
            return self.ids, False
        if self.kind == "and" and len(self.parts) == 2:
            kinds = {p.kind: p for p in self.parts}
            if set(kinds) == {"causal", "document"}:
                ids = kinds["document"].ids
                assert ids is not None
                return ids, True
        return None


@dataclass(frozen=True, eq=False)
class ScoreKind:
    """One score, classified. ``kind`` is one of :data:`SCORE_KINDS`.

    - ``bias``: ``bias``, a 4-D float tensor broadcastable to ``[B, Hq, Lq, Lk]``.
    - ``alibi`` / ``softcap`` / ``relative`` / ``mod``: ``score_mod``, a callable
      ``(score, b, h, q_idx, kv_idx) -> score``; ``evaluation`` as for masks.
    """

    kind: str
    score_mod: Callable[..., Any] | None = None
    bias: Tensor | None = None
    source: object = None
    evaluation: str = "broadcast"

    @property
    def given(self) -> object:
        """What was passed as ``score_mod=`` (a bias right-aligned to 4 dims)."""
        return self.source

    @property
    def is_callable(self) -> bool:
        """True when a callable is applied to the scores (everything but none and bias)."""
        return self.score_mod is not None

    @property
    def name(self) -> str:
        if self.kind == "none":
            return "none"
        if self.bias is not None:
            return f"bias tensor {list(self.bias.shape)}"
        return describe(self.source if self.source is not None else self.score_mod)


NO_MASK = MaskKind("none", _AllTrue())
NO_SCORE = ScoreKind("none")


def describe(obj: object) -> str:
    """A mask_mod's or score_mod's name: qkv's own by repr, a user's by ``__name__``."""
    if obj is None:
        return "none"
    if isinstance(obj, Tensor):
        return f"{'bool' if obj.dtype == torch.bool else 'bias'} tensor {list(obj.shape)}"
    return callable_name(obj)


# ------------------------------------------------------------------------------ masks


def _evaluation(fn: object) -> str:
    """How a user mod is called: "vmap" once it is known to work only under FlexAttention's
    convention (``qkv._flex.compat``), else "broadcast" (a score_mod decides on its first
    call, so its kind may say "broadcast" until then)."""
    return "vmap" if isinstance(fn, ModCall) and fn.decided and fn.why is not None else "broadcast"


def classify_mask(mask: object) -> MaskKind:
    """The kind of a mask: ``None``, a 4-D bool tensor (already checked), a built-in mask or
    combination, or a user mask_mod. A :class:`qkv.BlockMask` is handled by the caller
    (it carries its kind)."""
    if mask is None:
        return NO_MASK
    if isinstance(mask, Tensor):
        return MaskKind("tensor", _TensorMaskMod(mask), source=mask, tensor=mask)
    if isinstance(mask, Band):
        return _band(mask.lo, mask.hi, mask)
    if isinstance(mask, KvBelow):
        return MaskKind("padding", mask, source=mask, limit=mask.limit, start=mask.start)
    if isinstance(mask, Document):
        return MaskKind("document", mask, source=mask, ids=mask.ids)
    if isinstance(mask, And):
        return _simplify_and(tuple(classify_mask(m) for m in mask.mods), mask)
    if isinstance(mask, Or):
        return _simplify_or(tuple(classify_mask(m) for m in mask.mods), mask)
    if callable(mask):
        return MaskKind("mod", mask, source=mask, evaluation=_evaluation(mask))
    raise TypeError(
        f"mask must be None, a bool tensor, a mask_mod callable (b, h, q_idx, kv_idx) -> bool, "
        f"a qkv.BlockMask or a FlexAttention BlockMask; got {type(mask).__name__}"
    )


def band(lo: int | None, hi: int | None, name: str | None = None) -> MaskKind:
    """The kind of the band ``lo <= kv_idx - q_idx <= hi`` (a new mask_mod)."""
    return _band(lo, hi, None, name)


def _band(lo: int | None, hi: int | None, source: object, name: str | None = None) -> MaskKind:
    if lo is None and hi is None:
        return replace(NO_MASK, source=source)
    if lo is None and hi == 0:
        mod: Any = source if isinstance(source, Band) else CAUSAL
        return MaskKind("causal", mod, source=source, lo=None, hi=0)
    if isinstance(source, Band) and (source.lo, source.hi) == (lo, hi):
        mod = source
    else:
        mod = Band(lo, hi, name or _band_name(lo, hi))
    return MaskKind("band", mod, source=source, lo=lo, hi=hi)


def _band_name(lo: int | None, hi: int | None) -> str:
    if lo is not None and lo <= 0 and hi is not None and hi >= 0:
        return f"qkv.sliding_window({-lo})" if hi == 0 else f"qkv.sliding_window({-lo}, {hi})"
    return f"band [{lo}, {hi}] of kv_idx - q_idx"


def _flatten(parts: tuple[MaskKind, ...], kind: str) -> list[MaskKind]:
    out: list[MaskKind] = []
    for p in parts:
        out.extend(p.parts if p.kind == kind else (p,))
    return out


def _simplify_and(parts: tuple[MaskKind, ...], source: object) -> MaskKind:
    flat = [p for p in _flatten(parts, "and") if p.kind != "none"]
    bands = [p for p in flat if p.is_band]
    if len(bands) > 1:  # bands intersect: the tightest edge on each side
        lows = [b.lo for b in bands if b.lo is not None]
        highs = [b.hi for b in bands if b.hi is not None]
        merged = band(max(lows) if lows else None, min(highs) if highs else None)
        flat = [merged, *(p for p in flat if not p.is_band)]
    return _combined("and", flat, parts, source)


def _by_lo(bands: list[MaskKind]) -> list[MaskKind]:
    """``bands`` by lower edge, unbounded first (stable), by comparisons only: ``sorted``
    cannot order symbolic ints while dynamo traces with dynamic shapes (a few bands at most)."""

    def before(a: MaskKind, b: MaskKind) -> bool:
        if a.lo is None or b.lo is None:
            return a.lo is None and b.lo is not None
        return bool(a.lo < b.lo)

    out: list[MaskKind] = []
    for b in bands:
        at = len(out)
        while at > 0 and before(b, out[at - 1]):
            at -= 1
        out.insert(at, b)
    return out


def _simplify_or(parts: tuple[MaskKind, ...], source: object) -> MaskKind:
    flat = _flatten(parts, "or")
    if any(p.kind == "none" for p in flat):
        return replace(NO_MASK, source=source, simplified=True)
    bands = _by_lo([p for p in flat if p.is_band])
    united: list[MaskKind] = []
    for b in bands:  # overlapping or touching bands unite into one
        last = united[-1] if united else None
        if last is not None and (last.hi is None or b.lo is None or b.lo <= last.hi + 1):
            hi = None if last.hi is None or b.hi is None else max(last.hi, b.hi)
            united[-1] = band(last.lo, hi)
        else:
            united.append(b)
    rest = [p for p in flat if not p.is_band]
    flat = [*united, *rest]
    below = [
        p for p in flat if p.kind == "padding" and isinstance(p.limit, int) and p.start is None
    ]
    if below and any(p.kind == "causal" for p in flat):  # kv_idx < P or causal: prefix-LM
        P = max(int(b.limit) for b in below)  # type: ignore[arg-type]
        mod = Or((KvBelow(P, f"kv_idx < {P}"), CAUSAL), f"qkv.prefix_lm({P})")
        prefix = MaskKind("prefix", mod, limit=P)
        flat = [prefix, *(p for p in flat if p.kind != "causal" and p not in below)]
    return _combined("or", flat, parts, source)


def _combined(
    kind: str, flat: list[MaskKind], parts: tuple[MaskKind, ...], source: object
) -> MaskKind:
    changed = len(flat) != len(parts) or any(a is not b for a, b in zip(flat, parts, strict=False))
    if not flat:
        return replace(NO_MASK, source=source, simplified=True)
    if len(flat) == 1:
        return replace(flat[0], source=source, simplified=True)
    if not changed:
        return MaskKind(kind, source, source=source, parts=tuple(flat))  # type: ignore[arg-type]
    mods = tuple(p.mask_mod for p in flat)
    joined = ", ".join(describe(m) for m in mods)
    mod = (And if kind == "and" else Or)(mods, f"qkv.{kind}_masks({joined})")
    return MaskKind(kind, mod, source=source, parts=tuple(flat), simplified=True)


# ----------------------------------------------------------------------------- scores


def classify_score(score_mod: object) -> ScoreKind:
    """The kind of a score: ``None``, a 4-D float bias (already checked), a built-in or a
    user score_mod."""
    if score_mod is None:
        return NO_SCORE
    if isinstance(score_mod, Tensor):
        return ScoreKind("bias", bias=score_mod, source=score_mod)
    for cls, kind in ((Alibi, "alibi"), (Softcap, "softcap"), (RelativeBias, "relative")):
        if isinstance(score_mod, cls):
            return ScoreKind(kind, score_mod=score_mod, source=score_mod)
    if callable(score_mod):
        return ScoreKind(
            "mod", score_mod=score_mod, source=score_mod, evaluation=_evaluation(score_mod)
        )
    raise TypeError(
        f"score_mod must be None, a float bias tensor, or a callable "
        f"(score, b, h, q_idx, kv_idx) -> score; got {type(score_mod).__name__}"
    )

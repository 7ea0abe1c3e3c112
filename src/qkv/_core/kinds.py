"""Masks and scores classified once, at the door.

:func:`classify_mask` turns whatever was passed as ``mask=`` into one :class:`MaskKind` and
:func:`classify_score` turns ``score_mod=`` into one :class:`ScoreKind`. A kind holds the mask
as a value of its class (:mod:`qkv._core.builtin_mods`: a tensor becomes a ``TensorMask``, a
user's mask_mod stays itself) and the terms the kernels read (:mod:`qkv._core.terms`); every
later layer asks these, never a tag.

Combinations of built-ins are simplified to the mask they are, so that they reach the same
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

from .builtin_mods import CAUSAL, AllTrue, Band, BuiltinMask, Prefix, TensorMask
from .builtin_scores import BuiltinScore
from .checks import callable_name
from .combinations import And, Combined, Or
from .terms import NONE, Terms, intersect_bands, meet_all
from .usermod import UserMod

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class MaskKind:
    """One mask, classified: ``mask_mod`` is the mask as a value of its class (a built-in, a
    ``TensorMask`` for a bool tensor, or a user's mask_mod), ``terms`` what the kernels read.

    - ``parts``: for an ``and``/``or`` of masks, each part classified (no nested and-in-and).
    - ``evaluation``: how a user's mask_mod is called (``"broadcast"``, or ``"vmap"`` for
      mods written for vmap).
    - ``block``: a prebuilt :class:`qkv.BlockMask` of this same mask (its tile plan), when one
      was passed: it is a plan of a mask rather than a kind of its own, so every layer reads
      the structure it was built from directly.
    """

    mask_mod: Callable[..., Any]
    terms: Terms = NONE
    source: object = None  # what was passed (names it in plans and errors)
    parts: tuple[MaskKind, ...] = ()
    block: Any = None  # qkv.BlockMask | None (blockmask.py imports this module)
    evaluation: str = "broadcast"
    simplified: bool = False  # True when a combination was reduced to a simpler mask

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
        return None if self.is_none and self.source is None else self.source

    @property
    def is_none(self) -> bool:
        """No mask: every position may attend."""
        return self.terms.empty

    @property
    def is_band(self) -> bool:
        """A band of diagonals and nothing else (causal and sliding windows among them)."""
        return self.terms.band is not None and self.terms.only(band=True)

    @property
    def is_causal(self) -> bool:
        """Causal and nothing else (top-left aligned: ``kv_idx <= q_idx``)."""
        return self.is_band and self.terms.causal

    @property
    def lo(self) -> int | None:
        """The band's lower edge (``None``: unbounded, or not a band)."""
        return self.terms.band[0] if self.terms.band is not None else None

    @property
    def hi(self) -> int | None:
        """The band's upper edge (``None``: unbounded, or not a band)."""
        return self.terms.band[1] if self.terms.band is not None else None

    @property
    def tensor(self) -> Tensor | None:
        """The bool tensor, for a mask given as one."""
        return self.mask_mod.t if isinstance(self.mask_mod, TensorMask) else None

    @property
    def is_user(self) -> bool:
        """A user's mask_mod (code qkv cannot read: evaluated position by position)."""
        return not isinstance(self.mask_mod, BuiltinMask)

    def with_block(self, bm: Any) -> MaskKind:
        return replace(self, block=bm)

    def document_causal(self) -> tuple[Tensor, bool] | None:
        """``(ids, causal)`` for ``document(ids)`` or ``and_masks(causal, document(ids))``;
        ``ids`` as the terms hold them, ``[R, L]`` (``R`` 1 or one row per batch element)."""
        t = self.terms
        if t.ids is None or not t.only(band=True, ids=True):
            return None
        if t.band is None:
            return t.ids, False
        return (t.ids, True) if t.causal else None


@dataclass(frozen=True, eq=False)
class ScoreKind:
    """One score, classified: ``bias``, a 4-D float tensor broadcastable to
    ``[B, Hq, Lq, Lk]``, or ``score_mod``, a callable ``(score, b, h, q_idx, kv_idx) ->
    score`` (a built-in's value or a user's, called as ``evaluation`` says); or neither."""

    score_mod: Callable[..., Any] | None = None
    bias: Tensor | None = None
    source: object = None
    evaluation: str = "broadcast"

    @property
    def given(self) -> object:
        """What was passed as ``score_mod=`` (a bias right-aligned to 4 dims)."""
        return self.source

    @property
    def is_none(self) -> bool:
        return self.score_mod is None and self.bias is None

    @property
    def is_callable(self) -> bool:
        """True when a callable is applied to the scores (everything but none and bias)."""
        return self.score_mod is not None

    @property
    def is_user(self) -> bool:
        """A user's score_mod (code qkv cannot read)."""
        return self.score_mod is not None and not isinstance(self.score_mod, BuiltinScore)

    @property
    def name(self) -> str:
        if self.is_none:
            return "none"
        if self.bias is not None:
            return f"bias tensor {list(self.bias.shape)}"
        return describe(self.source if self.source is not None else self.score_mod)


NO_MASK = MaskKind(AllTrue())
NO_SCORE = ScoreKind()


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
    return "vmap" if isinstance(fn, UserMod) and fn.vmap_only else "broadcast"


def classify_mask(mask: object) -> MaskKind:
    """The kind of a mask: ``None``, a 4-D bool tensor (already checked), a built-in mask or
    combination, or a user mask_mod. A :class:`qkv.BlockMask` is handled by the caller
    (it carries its kind)."""
    if mask is None:
        return NO_MASK
    if isinstance(mask, Tensor):
        return MaskKind(TensorMask(mask), Terms(rest=(mask,)), source=mask)
    if isinstance(mask, Band):
        return _band(mask.lo, mask.hi, mask)
    if isinstance(mask, And):
        return _simplify_and(tuple(classify_mask(m) for m in mask.mods), mask)
    if isinstance(mask, Or):
        return _simplify_or(tuple(classify_mask(m) for m in mask.mods), mask)
    if isinstance(mask, BuiltinMask):  # its class says what it is
        return MaskKind(mask, mask.terms(), source=mask)
    if callable(mask):
        return MaskKind(mask, Terms(rest=(mask,)), source=mask, evaluation=_evaluation(mask))
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
    if isinstance(source, Band) and (source.lo, source.hi) == (lo, hi):
        mod: Band = source
    elif lo is None and hi == 0:
        mod = CAUSAL
    else:
        mod = Band(lo, hi, name or Band.named(lo, hi))
    return MaskKind(mod, Terms(band=(lo, hi)), source=source)


def _flatten(parts: tuple[MaskKind, ...], cls: type[Combined]) -> list[MaskKind]:
    out: list[MaskKind] = []
    for p in parts:
        out.extend(p.parts if p.parts and type(p.mask_mod) is cls else (p,))
    return out


def _simplify_and(parts: tuple[MaskKind, ...], source: object) -> MaskKind:
    flat = [p for p in _flatten(parts, And) if not p.is_none]
    bands = [p for p in flat if p.is_band]
    if len(bands) > 1:  # bands intersect: the tightest edge on each side
        edges = bands[0].terms.band
        for b in bands[1:]:
            edges = intersect_bands(edges, b.terms.band)  # type: ignore[arg-type]
        merged = band(*edges)  # type: ignore[misc]
        flat = [merged, *(p for p in flat if not p.is_band)]
    return _combined(And, flat, parts, source)


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


def _key_prefix(p: MaskKind) -> int | None:
    """``P`` when ``p`` is ``kv_idx < P`` for an int ``P`` and nothing else."""
    keys = p.terms.keys
    if keys is None or keys.start is not None or not p.terms.only(keys=True):
        return None
    return keys.limit if isinstance(keys.limit, int) else None


def _simplify_or(parts: tuple[MaskKind, ...], source: object) -> MaskKind:
    flat = _flatten(parts, Or)
    if any(p.is_none for p in flat):
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
    below = [p for p in flat if _key_prefix(p) is not None]
    if below and any(p.is_causal for p in flat):  # kv_idx < P or causal: prefix-LM
        prefix = Prefix(max(P for P in map(_key_prefix, below) if P is not None))
        flat = [
            MaskKind(prefix, prefix.terms()),
            *(p for p in flat if not p.is_causal and p not in below),
        ]
    return _combined(Or, flat, parts, source)


def _combined(
    cls: type[Combined], flat: list[MaskKind], parts: tuple[MaskKind, ...], source: object
) -> MaskKind:
    changed = len(flat) != len(parts) or any(a is not b for a, b in zip(flat, parts, strict=False))
    if not flat:
        return replace(NO_MASK, source=source, simplified=True)
    if len(flat) == 1:
        return replace(flat[0], source=source, simplified=True)
    if not changed:
        mod: Combined = source  # type: ignore[assignment]
    else:
        mods = tuple(p.mask_mod for p in flat)
        joined = ", ".join(describe(m) for m in mods)
        mod = cls(mods, f"qkv.{cls.word}_masks({joined})")
    terms = meet_all([(p.terms, p.mask_mod) for p in flat]) if cls is And else Terms(rest=(mod,))
    return MaskKind(mod, terms, source=source, parts=tuple(flat), simplified=changed)


# ----------------------------------------------------------------------------- scores


def classify_score(score_mod: object) -> ScoreKind:
    """The kind of a score: ``None``, a 4-D float bias (already checked), a built-in or a
    user score_mod."""
    if score_mod is None:
        return NO_SCORE
    if isinstance(score_mod, Tensor):
        return ScoreKind(bias=score_mod, source=score_mod)
    if isinstance(score_mod, BuiltinScore):
        return ScoreKind(score_mod=score_mod, source=score_mod)
    if callable(score_mod):
        return ScoreKind(score_mod=score_mod, source=score_mod, evaluation=_evaluation(score_mod))
    raise TypeError(
        f"score_mod must be None, a float bias tensor, or a callable "
        f"(score, b, h, q_idx, kv_idx) -> score; got {type(score_mod).__name__}"
    )

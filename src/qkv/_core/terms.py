"""A mask as the terms kernels know: what every backend reads instead of a mask's class.

Each built-in mask says which terms it is (``terms()`` on its class,
:mod:`qkv._core.builtin_mods`), and a combination with ``and`` meets its parts' terms. The
kernels read the terms: the decode kernel takes a band and a key range per batch element, the
Triton kernel a band, a prefix, a key range and document ids, the fused-kernel segments a
prefix or sorted documents; whatever is not one of these terms (an ``or`` that is no band, a
bool tensor, a user's mask_mod, a second term of one kind) is *rest*, evaluated position by
position where the kernel needs positions. A new mask class that is one of these terms runs on
every kernel that takes the term, without a line elsewhere.

    sliding_window(64)                  band (-64, 0)
    and_masks(causal, document(ids))    band (None, 0), ids
    and_masks(causal, padding(lengths)) band (None, 0), keys (lengths, None)
    prefix_lm(16)                       prefix 16
    or_masks(a, b), a bool tensor, f    rest (the mask itself)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class Keys:
    """``start[b] <= kv_idx < limit[b]``: ``limit`` an int or ``[B]`` tensor of ends,
    ``start`` ``None`` (0), an int, or a ``[B]`` tensor (left padding)."""

    limit: int | Tensor
    start: int | Tensor | None = None

    def per_batch(self, B: int, dtype: torch.dtype = torch.int64) -> tuple[Tensor, Tensor]:
        """``(start, limit)`` as ``[B]`` tensors of ``dtype`` (on the tensors' device, or the
        CPU for ints)."""
        start = 0 if self.start is None else self.start
        return tuple(  # type: ignore[return-value]
            t.to(dtype).expand(B) if isinstance(t, Tensor) else torch.full((B,), t, dtype=dtype)
            for t in (start, self.limit)
        )


@dataclass(frozen=True, eq=False)
class Terms:
    """The and of a mask's terms (each ``None`` when absent; see the module docstring).

    - ``band``: ``lo <= kv_idx - q_idx <= hi`` (``None`` edge = unbounded; causal is
      ``(None, 0)``).
    - ``prefix``: ``kv_idx < prefix`` or causal (``qkv.prefix_lm``).
    - ``keys``: a key range per batch element (:class:`Keys`).
    - ``ids``: ``ids[b, q_idx] == ids[b, kv_idx]`` (documents), ``[R, L]`` with ``R`` 1
      (one row that every batch element shares) or ``B`` (a row per batch element).
    - ``rest``: mask_mods that are none of these, evaluated position by position.
    """

    band: tuple[int | None, int | None] | None = None
    prefix: int | None = None
    keys: Keys | None = None
    ids: Tensor | None = None
    rest: tuple[object, ...] = ()

    @property
    def empty(self) -> bool:
        """No term at all: every position may attend."""
        return self.band is None and self.only(band=True)

    def only(
        self, *, band: bool = False, prefix: bool = False, keys: bool = False, ids: bool = False
    ) -> bool:
        """True when the terms not named are all absent (the named ones may be present)."""
        return (
            (band or self.band is None)
            and (prefix or self.prefix is None)
            and (keys or self.keys is None)
            and (ids or self.ids is None)
            and len(self.rest) == 0  # (len: dynamo cannot take "not" of a tuple)
        )

    @property
    def causal(self) -> bool:
        """The band is causal's (``kv_idx <= q_idx``, no lower edge)."""
        return self.band is not None and self.band[0] is None and self.band[1] == 0

    def meet(self, other: Terms) -> Terms | None:
        """The terms of ``self and other``; ``None`` when both hold a term no kernel
        intersects (two key ranges, two prefixes, two id tensors): the caller keeps the
        second mask as rest. Bands intersect: the tightest edge on each side."""
        band = self.band
        if other.band is not None:
            band = other.band if band is None else intersect_bands(band, other.band)
        out = replace(self, band=band, rest=self.rest + other.rest)
        for name in ("prefix", "keys", "ids"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if theirs is None:
                continue
            if mine is not None:
                return None
            out = replace(out, **{name: theirs})
        return out


NONE = Terms()


def meet_all(parts: list[tuple[Terms, object]]) -> Terms:
    """The terms of the and of ``parts`` (each its terms and its mask_mod): met in order; a
    part whose term is already taken stays rest (its mask_mod evaluated)."""
    out = NONE
    for terms, mod in parts:
        met = out.meet(terms)
        out = met if met is not None else replace(out, rest=(*out.rest, mod))
    return out


def intersect_bands(
    a: tuple[int | None, int | None], b: tuple[int | None, int | None]
) -> tuple[int | None, int | None]:
    """The band both allow: the tightest edge on each side (``None`` = unbounded)."""
    lows = [x for x in (a[0], b[0]) if x is not None]
    highs = [x for x in (a[1], b[1]) if x is not None]
    return (max(lows) if lows else None, min(highs) if highs else None)

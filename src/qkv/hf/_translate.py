"""transformers' mask description → one qkv mask over the attention call's buffer.

transformers describes every mask as a ``mask_function(batch_idx, head_idx, q_idx, kv_idx)``
(FlexAttention's convention, True = attend) built from a handful of closures in
``transformers.masking_utils`` — ``causal_mask_function``, ``sliding_window_overlay(w)``,
``padding_mask_function(pm)``, ``packed_sequence_mask_function(ids)``, ``and_masks``,
``or_masks`` ... — evaluated at *absolute* positions ``q_idx + q_offset``,
``kv_idx + kv_offset``. Its own ``sdpa``/``eager`` mask builders evaluate that function on
every ``[B, 1, Lq, Lk]`` position. Here the closures are read instead (their names and the
values they close over), so each becomes the qkv built-in it is, already shifted into buffer
coordinates:

    causal_mask_function                  kv <= q             -> band (-inf, d]
    sliding_window_overlay(w)             kv > q - w          -> band [1 - w + d, inf)
    sliding_window_bidirectional_overlay  |q - kv| <= w       -> band [-w + d, w + d]
    bidirectional_mask_function           everything          -> no mask
    padding_mask_function(pm)             pm[b, kv]           -> qkv.padding(lengths, start=),
                                                                 or a key mask with holes
    packed_sequence_mask_function(ids)    ids[b,q] == ids[b,kv] -> qkv.document(ids)
    and_masks / or_masks                                      -> qkv.and_masks / or_masks

with ``d = q_offset - kv_offset`` (the buffer band ``lo <= j - i <= hi`` of an absolute band
``lo' <= kv_abs - q_abs <= hi'`` is ``lo = lo' + d``). qkv then plans the result
block-sparse: a window skips the key blocks it cannot see, and ``and(causal, window)`` is the
band kernel. Anything not recognised (a model's own overlay, chunked attention with per-row
left padding, the multimodal blockwise overlay) stays a mask_mod, called with broadcast index
tensors at absolute positions: exact, evaluated tile by tile.

Under ``torch.compile`` transformers makes these closures inside the compiled function, and
dynamo cannot read a cell of such a closure: a closure whose values are needed stays a
mask_mod there, ``causal_mask_function`` (no closure) is still the causal band, and no value
of a tensor decides a kind (a padding mask stays a key mask, per-row documents stay per row).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import masks
from .._core.kinds import band, classify_mask
from .._core.tracing import is_symbolic
from .._positions import MaskAt, shift_band

Tensor = torch.Tensor

_MODULE = "transformers.masking_utils"


class Frame:
    """Where one attention call's buffer sits in the sequence."""

    def __init__(self, B: int, Lq: int, Lk: int, q_offset: int, kv_offset: int) -> None:
        self.B, self.Lq, self.Lk = B, Lq, Lk
        self.q_offset, self.kv_offset = q_offset, kv_offset
        self.d = q_offset - kv_offset  # kv_abs - q_abs = (j - i) - d


def _shape(t: Tensor) -> str:
    """``t``'s shape for a name; a size that is symbolic while dynamo traces (a second
    sequence length makes it so) as ``?``: a name must be a constant there."""
    return "[" + ", ".join(["?" if is_symbolic(n) else str(n) for n in t.shape]) + "]"


class _KeyMask:
    """``keep[b, kv_idx]``: key padding that is not a prefix of each row (left padding)."""

    def __init__(self, keep: Tensor) -> None:
        self.keep = keep  # [B, Lk] bool, buffer coordinates

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = self.keep.to(kv_idx.device)
        if keep.shape[0] == 1:
            b = torch.zeros_like(b)
        return keep[b, kv_idx]  # [B|1, 1, 1, Lk]

    def __repr__(self) -> str:
        return f"key padding mask {_shape(self.keep)}"

    @property
    def __name__(self) -> str:
        return repr(self)


def _closure(fn: Any) -> dict[str, Any]:
    """The values ``fn`` closes over, by name; ``{}`` for a closure made inside a
    ``torch.compile`` trace (dynamo cannot read its cells), which then stays a mask_mod."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    try:
        cells = fn.__closure__ or ()
    except AttributeError:  # made in the trace: no cells to read
        return {}
    return {name: c.cell_contents for name, c in zip(code.co_freevars, cells, strict=False)}


def _which(fn: Any) -> str | None:
    """The transformers closure ``fn`` is (``"and_masks"``, ``"causal_mask_function"``, ...),
    or ``None`` for anything else. Read from the code object's qualified name, which dynamo
    can read where it cannot read the function's ``__qualname__`` (that one on Python 3.10,
    whose code objects have none: there a compiled model breaks the graph here)."""
    if getattr(fn, "__module__", None) != _MODULE:
        return None
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    qual = getattr(code, "co_qualname", None)  # Python >= 3.11
    if qual is None:
        qual = getattr(fn, "__qualname__", "")
    return str(qual).split(".<locals>.")[0]


# Sentinels inside the translation: "every position" (drops out of an and, absorbs an or).
_ALL = object()


def translate(fn: Any, frame: Frame, padding: Tensor | None) -> object:
    """The qkv mask (``None`` = no mask) equal to ``fn`` on ``frame``'s buffer, and-ed with the
    2-D key ``padding`` mask ``[B, >= kv_offset + Lk]`` (True = a real token) when given."""
    parts = [fn] if padding is None else [fn, ("padding", padding)]
    out = _and([_one(p, frame, parts) for p in parts])
    return None if out is _ALL else out


def _one(fn: Any, f: Frame, siblings: list[Any]) -> object:
    if isinstance(fn, tuple) and fn[0] == "padding":
        return _padding(fn[1], f)
    which, cl = _which(fn), _closure(fn)
    if which == "causal_mask_function":
        return _band(None, 0, f)
    if which == "bidirectional_mask_function":
        return _ALL
    if which == "sliding_window_overlay" and isinstance(cl.get("sliding_window"), int):
        return _band(1 - cl["sliding_window"], None, f)
    if which == "sliding_window_bidirectional_overlay" and isinstance(
        cl.get("sliding_window"), int
    ):
        w = cl["sliding_window"]
        return _band(-w, w, f)
    if which == "padding_mask_function" and isinstance(cl.get("padding_mask"), Tensor):
        return _padding(cl["padding_mask"], f)
    if (
        which == "packed_sequence_mask_function"
        and isinstance(cl.get("packed_sequence_mask"), Tensor)
        and f.d == 0
        and f.kv_offset == 0
    ):
        return _documents(cl["packed_sequence_mask"], f)
    if which in ("and_masks", "or_masks") and "mask_functions" in cl:
        mods = list(cl["mask_functions"])
        parts = [_one(m, f, mods) for m in mods]
        return _and(parts) if which == "and_masks" else _or(parts)
    inner = cl.get("mask_function")
    if (
        which == "remap_positions_for_packed_sequence"
        and callable(inner)
        and _packed_sibling(siblings)
    ):
        # Inside one packed document the position ids count up by one, exactly like the
        # buffer indices (that is how transformers finds the documents), so a mask that
        # depends only on kv - q is the same at either; the document sibling keeps the rows
        # apart.
        translated = _one(inner, f, [])
        if _is_band(translated):
            return translated
    return MaskAt(fn, f.q_offset, f.kv_offset, f.q_offset + f.Lq)


def _band(lo: int | None, hi: int | None, f: Frame) -> object:
    """The absolute band ``lo <= kv_abs - q_abs <= hi`` on the buffer (qkv's KV-cache shift);
    every position when it covers the whole buffer (a decoding step's causal mask: its one
    query sees every cached key, so it runs unmasked)."""
    shifted = shift_band(band(lo, hi), f.d, f.Lq, f.Lk)
    return _ALL if shifted is None else shifted


def _is_band(m: object) -> bool:
    return m is _ALL or classify_mask(m).is_band


def _packed_sibling(siblings: list[Any]) -> bool:
    return any(_which(s) == "packed_sequence_mask_function" for s in siblings)


def _padding(pm: Tensor, f: Frame) -> object:
    keep = pm.to(torch.bool)
    end = f.kv_offset + f.Lk
    if keep.shape[-1] < end:  # transformers pads a short 2-D mask with False (static caches)
        keep = torch.nn.functional.pad(keep, (0, end - keep.shape[-1]), value=False)
    keep = keep[:, f.kv_offset : end]  # [B, Lk] buffer coordinates
    if torch.compiler.is_compiling():  # no value decides the kind in a graph: exact as it is
        return _KeyMask(keep)
    if bool(keep.all()):
        return _ALL
    lengths = keep.sum(-1)  # [B]
    start = keep.to(torch.int8).argmax(-1)  # [B] first real key (0 for a row with none)
    arange = torch.arange(f.Lk, device=keep.device)
    span = (arange >= start[:, None]) & (arange < (start + lengths)[:, None])  # [B, Lk]
    if bool((keep == span).all()):  # one run of real keys per row: left and/or right padding
        if not bool(start.any()):
            return masks.padding(lengths.to(torch.int64))
        return masks.padding(lengths.to(torch.int64), start=start.to(torch.int64))
    return _KeyMask(keep)


def _documents(ids: Tensor, f: Frame) -> object:
    """transformers' packed-sequence ids ``[B, L]`` (or ``[1, L]``) as ``qkv.document``, one
    row of ids per batch element: no value is read to decide it (so it is the same under
    torch.compile), and every kernel reads the rows as they are (the band kernel narrows each
    row's blocks to its documents)."""
    ids = ids[:, : max(f.Lq, f.Lk)].to(torch.int64)  # [B|1, L]
    return masks.document(ids[0] if ids.shape[0] == 1 else ids)


def _and(parts: list[object]) -> object:
    kept = [p for p in parts if p is not _ALL]
    if not kept:
        return _ALL
    return kept[0] if len(kept) == 1 else masks.and_masks(*kept)  # type: ignore[arg-type]


def _or(parts: list[object]) -> object:
    if any(p is _ALL for p in parts):
        return _ALL
    return parts[0] if len(parts) == 1 else masks.or_masks(*parts)  # type: ignore[arg-type]

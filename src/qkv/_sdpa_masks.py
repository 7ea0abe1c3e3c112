"""Recognise the dense masks PyTorch models pass to SDPA, so qkv's planner sees their structure.

Models build masks as tensors: nanoGPT and ``nn.Transformer`` a causal triangle,
sliding-window models a band, encoders a key-padding mask ``[B, 1, 1, Lk]``. As tensors they
cost a pass over ``Lq × Lk`` positions in every call; as :data:`qkv.causal`,
:func:`qkv.sliding_window` or :func:`qkv.padding` the block-sparse engine skips the empty
blocks. Recognising one reads the mask's values: one pass over it (and, off the CPU, a sync),
which is why it is skipped for small masks (where the dense path is already cheap), kept per
mask tensor while it is unchanged, and never done under ``torch.compile`` (values are unknown
while tracing: the tensor goes as it is).

Used only by :mod:`qkv.torch_sdpa`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .masks import causal, padding, sliding_window

Tensor = torch.Tensor

# Problems with fewer scores per head (Lq * Lk) than this pass their mask as it is: below it
# the dense kernel's whole call costs about what reading the mask does (measured in
# benchmarks/torch_sdpa.py; RESULTS.md, 2026-12-04).
MIN_POSITIONS = 1 << 16

_CACHE_SIZE = 32
# id(mask) -> (weak reference, version, what it was recognised as)
_cache: dict[int, tuple[weakref.ref[Tensor], int, Any]] = {}
_lock = threading.Lock()


def recognise(mask: Any, bias: Tensor | None, batch: int, scores: int) -> tuple[Any, Tensor | None]:
    """``(mask, bias)`` as :func:`qkv.attention` should get them: a recognised mask as a
    built-in mask_mod (a float bias of only 0 and -inf as a mask), anything else unchanged.

    ``mask`` is ``None``, a mask_mod, or a bool tensor ``[B or 1, H or 1, Lq or 1, Lk or 1]``;
    ``bias`` a float tensor of that shape or ``None``; ``batch`` is B and ``scores`` is
    ``Lq * Lk``, the positions a dense kernel computes per head.
    """
    if torch.compiler.is_compiling() or scores < MIN_POSITIONS:
        return mask, bias
    if bias is not None:
        if mask is not None or bias.requires_grad:
            return mask, bias
        as_mask = _cached(bias, batch, _from_bias)
        return (mask, bias) if as_mask is _UNKNOWN else (as_mask, None)
    if not isinstance(mask, Tensor):
        return mask, bias
    got = _cached(mask, batch, _from_bool)
    return (mask, None) if got is _UNKNOWN else (got, None)


class _Unknown:
    """Not recognised: the tensor goes as it is."""


_UNKNOWN = _Unknown()


def _cached(t: Tensor, batch: int, read: Any) -> Any:
    # An inference tensor has no version counter to tell an in-place edit: read every time.
    if t.is_inference():
        return read(t, batch)
    key = id(t)
    with _lock:
        hit = _cache.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2][0] == batch:
        return hit[2][1]
    got = read(t, batch)
    with _lock:
        if len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))  # the oldest entry
        _cache[key] = (weakref.ref(t), t._version, (batch, got))
    return got


def _from_bias(bias: Tensor, batch: int) -> Any:
    """A float mask of only 0 and -inf is a bool mask (0 = attend): recognised as one, or the
    bool tensor itself; any other float mask stays a bias."""
    keep = bias == 0
    if not bool((keep | (bias == float("-inf"))).all()):
        return _UNKNOWN
    got = _from_bool(keep, batch)
    return keep if got is _UNKNOWN else got


def _from_bool(m: Tensor, batch: int) -> Any:
    """A bool mask ``[B', H', Lq', Lk']`` as a built-in mask, or ``_UNKNOWN``."""
    b, h, lq, lk = m.shape
    if b == 1 and h == 1 and lq > 1 and lk > 1:
        return _band(m[0, 0])
    if h == 1 and lq == 1 and lk > 1:
        return _key_range(m[:, 0, 0], batch)
    return _UNKNOWN


def _band(m: Tensor) -> Any:
    """``m [Lq, Lk]`` equal to ``kv - q`` within ``[lo, hi]`` with ``lo <= 0 <= hi``: all True
    (no mask), causal, or a sliding window."""
    lq, lk = m.shape
    if bool(m.all()):
        return None
    diag = (
        torch.arange(lk, device=m.device) - torch.arange(lq, device=m.device)[:, None]
    )  # [Lq, Lk]
    big = lq + lk
    lo = int(diag.masked_fill(~m, big).min())
    hi = int(diag.masked_fill(~m, -big).max())
    if not lo <= 0 <= hi:
        return _UNKNOWN  # empty, or a band off the main diagonal: sliding_window cannot say it
    if not torch.equal((diag >= lo) & (diag <= hi), m):
        return _UNKNOWN
    if hi == 0 and lo <= 1 - lq:
        return causal  # every key up to the query: top-left causal
    return sliding_window(-lo, hi)


def _key_range(rows: Tensor, batch: int) -> Any:
    """``rows [B', Lk]`` each one run of True keys: :func:`qkv.padding` (left padding too)."""
    lk = rows.shape[-1]
    lengths = rows.sum(-1)  # [B']
    start = rows.to(torch.uint8).argmax(-1)  # [B'] the first True (0 for a row of none)
    pos = torch.arange(lk, device=rows.device)  # [Lk]
    want = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])  # [B', Lk]
    if not torch.equal(want, rows):
        return _UNKNOWN
    if bool(lengths.eq(lk).all()):
        return None
    lengths, start = lengths.expand(batch), start.expand(batch)  # [B]
    if bool(start.eq(0).all()):
        return padding(lengths.contiguous())
    return padding(lengths.contiguous(), start=start.contiguous())

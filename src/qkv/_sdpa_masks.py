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
from collections.abc import Callable
from typing import Any

import torch

from ._core.lru import LRU
from .masks import causal, padding, sliding_window

Tensor = torch.Tensor

# Problems with fewer scores per head (Lq * Lk) than this pass their mask as it is: there the
# read is a large share of a dense call and the tiles it could skip are few. Reading a causal
# mask cost 0.40 of one dense 8-head call of torch's at 128 x 128, 0.17 at 256 x 256 (2**16),
# 0.12 at 1024 x 1024, once per mask tensor (benchmarks/torch_sdpa.py; RESULTS.md, 2026-12-04).
MIN_POSITIONS = 1 << 16

# (id(attn_mask), how it was used) -> (weak reference, version, what it was recognised as)
_cache: LRU[tuple[int, tuple[Any, ...]], tuple[weakref.ref[Tensor], int, Any]] = LRU(32)
_lock = threading.Lock()


def recognise(
    mask: Any, bias: Tensor | None, batch: int, scores: int, source: Tensor, causal_too: bool
) -> tuple[Any, Tensor | None]:
    """``(mask, bias)`` as :func:`qkv.attention` should get them: a recognised mask as a
    built-in mask_mod (a float bias of only 0 and -inf as a mask), anything else unchanged.

    ``mask`` is ``None``, a mask_mod, or a bool tensor ``[B or 1, H or 1, Lq or 1, Lk or 1]``;
    ``bias`` a float tensor of that shape or ``None``; ``batch`` is B and ``scores`` is
    ``Lq * Lk``, the positions a dense kernel computes per head. ``source`` is the caller's
    ``attn_mask`` (the answer is kept per source tensor, its version and how it was used:
    ``causal_too`` when ``is_causal`` was given beside it).
    """
    if torch.compiler.is_compiling() or scores < MIN_POSITIONS:
        return mask, bias
    read: Callable[[Tensor, int], Any]
    if bias is not None:
        if mask is not None or bias.requires_grad:
            return mask, bias
        t, read = bias, _from_bias
    elif isinstance(mask, Tensor):
        t, read = mask, _from_bool
    else:
        return mask, bias
    got = _cached(source, (batch, tuple(t.shape), causal_too), lambda: read(t, batch))
    if got is _UNKNOWN:
        return mask, bias
    return got, None


class _Unknown:
    """Not recognised: the tensor goes as it is."""


_UNKNOWN = _Unknown()


def _cached(source: Tensor, how: tuple[Any, ...], read: Any) -> Any:
    # An inference tensor has no version counter to tell an in-place edit: read every time.
    if source.is_inference():
        return read()
    key = (id(source), how)
    with _lock:
        hit = _cache.get(key)
    if hit is not None and hit[0]() is source and hit[1] == source._version:
        return hit[2]
    got = read()
    with _lock:
        _cache.put(key, (weakref.ref(source), source._version, got))
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


def _runs(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's first True key and its count of True keys (0 and 0 for a row of none): two
    passes over bytes (a bool tensor viewed as uint8 is free)."""
    u = rows.contiguous().view(torch.uint8)
    return u.argmax(-1), u.sum(-1, dtype=torch.int64)


def _band(m: Tensor) -> Any:
    """``m [Lq, Lk]`` equal to ``lo <= kv - q <= hi`` with ``lo <= 0 <= hi``: all True (no
    mask), causal, or a sliding window. Reads each row's run of True keys, derives the one band
    they could be, and compares the mask with it (one more pass)."""
    lq, lk = m.shape
    first, count = _runs(m)
    if not bool(count.gt(0).all()):
        return _UNKNOWN  # a row with no key: not a band around the diagonal
    rows = torch.arange(lq, device=m.device)
    lo = int((first - rows).min())
    hi = int((first + count - 1 - rows).max())
    if not lo <= 0 <= hi:
        return _UNKNOWN  # off the main diagonal: sliding_window cannot say it
    if lo <= 1 - lq and hi >= lk - 1:
        want = None  # every key: no mask, if m is all True
        band = torch.ones(lq, lk, dtype=torch.bool, device=m.device)
    else:
        band = torch.ones(lq, lk, dtype=torch.bool, device=m.device).tril(hi).triu(lo)
        want = causal if hi == 0 and lo <= 1 - lq else sliding_window(-lo, hi)
    return want if torch.equal(band, m) else _UNKNOWN


def _key_range(rows: Tensor, batch: int) -> Any:
    """``rows [B', Lk]`` each one run of True keys: :func:`qkv.padding` (left padding too)."""
    lk = rows.shape[-1]
    start, lengths = _runs(rows)  # [B'], [B']
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

"""KV caches for incremental decoding with :class:`qkv.MultiHeadAttention`.

A cache belongs to one attention layer. It stores the layer's keys (after qk_norm and RoPE, at
their absolute positions) and values in buffers allocated once, at the first call, to the
maximum length; each call writes the new keys in place and attends to a view of the buffer,
so decoding a token costs no re-allocation or copy of what is cached.

Under autograd (grad enabled and the new keys require grad) the writes are out of place
instead, so gradients reach earlier steps correctly; wrap decoding in ``torch.no_grad()`` or
``torch.inference_mode()`` for the in-place path.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ._cache_state import StepGuard
from ._core.kinds import band
from ._door import mask_kind
from ._positions import RingPositions, band_covers, mask_at, score_at
from .masks import and_masks
from .typing import MaskLike, ScoreLike

Tensor = torch.Tensor

__all__ = ["KVCache", "SlidingWindowCache"]


class _Cache(StepGuard):
    """What both caches share: the length, the owner layer, the buffers and their spec, and
    the guard that lets one step at a time in."""

    _capacity: int

    def __init__(self) -> None:
        self._length = 0
        self._k: Tensor | None = None  # [B, Hkv, capacity, D]
        self._v: Tensor | None = None  # [B, Hkv, capacity, Dv]
        self._owner: weakref.ref[Any] | None = None  # the owner layer's LayerKey
        self._init_guard()

    @property
    def length(self) -> int:
        """How many tokens have gone through the cache (the next token's position)."""
        return self._length

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept and reused)."""
        with self._claimed("be reset"):
            self._length = 0
            self._owner = None
            if self._k is not None and self._v is not None:  # let go of any autograd graph
                self._k, self._v = self._k.detach(), self._v.detach()

    # ------------------------------------------------------------------------ the step

    def _check_step(
        self,
        layer: object,
        *,
        B: int,
        Hkv: int,
        D: int,
        dtype: torch.dtype,
        device: torch.device,
        Lq: int,
        mask: object,
        score_mod: object,
    ) -> None:
        """Let in a step of ``layer`` (the ``LayerKey`` of the attention module calling,
        which will append keys ``[B, Hkv, Lq, D]`` of ``dtype`` on ``device``), or refuse it
        before anything is computed; allocate the buffers on first use. Once this returns,
        the caller owns the cache until it calls :meth:`_end_step` (in a ``finally``). The
        cache knows its layer only by identity: it reads no attribute of it, so this module
        does not depend on the module layer above it."""
        self._enter("take another step")
        try:
            owner = self._owner() if self._owner is not None else None
            if owner is not None and owner is not layer:
                raise ValueError(
                    f"this {type(self).__name__} already holds {self.length} tokens of another "
                    f"attention layer; a cache belongs to one layer: make one per layer, or "
                    f"reset() it first"
                )
            spec = (B, Hkv, self._capacity, D)
            k = self._k
            if k is not None and k.shape == spec and (k.dtype, k.device) == (dtype, device):
                # (dynamo cannot ask; inference mode and compiling do not mix anyway)
                traced = torch.compiler.is_compiling()
                if not traced and k.is_inference() and not torch.is_inference_mode_enabled():
                    if self.length > 0:
                        raise RuntimeError(
                            f"this {type(self).__name__} was filled under torch.inference_mode(), "
                            f"so its buffers can only be written there; keep decoding inside "
                            f"inference_mode (or reset() the cache to start over outside it)"
                        )
                    k = None  # reallocate outside inference mode
            elif k is not None and self.length > 0:
                raise ValueError(
                    f"this {type(self).__name__} holds {self.length} tokens of batch size "
                    f"{k.shape[0]}, {k.dtype}, on {k.device}; the new input has batch size {B}, "
                    f"{dtype}, on {device}: reset() the cache to start a new sequence"
                )
            else:
                k = None
            if k is None:  # the one allocation, to the full capacity
                self._k = torch.zeros(spec, dtype=dtype, device=device)
                self._v = torch.zeros(spec, dtype=dtype, device=device)
            self._check_room(Lq)
            if owner is None:  # unowned (new, reset, loaded alone, or its layer is gone): adopt
                self._owner = weakref.ref(layer)
        except BaseException:
            self._end_step()  # (stands aside under torch.compile, as _enter does)
            raise

    def _check_room(self, Lq: int) -> None:
        pass

    def _advance(self, n: int) -> None:
        """The attention call succeeded: commit its ``n`` tokens."""
        self._length += n

    def _write(self, name: str, index: slice | Tensor, new: Tensor) -> Tensor:
        """Write ``new [B, Hkv, n, D]`` into buffer ``name`` along the length dim."""
        buf = getattr(self, name)
        if torch.is_grad_enabled() and (new.requires_grad or buf.requires_grad):
            # Out of place, so autograd sees every step's keys as they were.
            if isinstance(index, slice):
                buf = buf.slice_scatter(new, dim=2, start=index.start, end=index.stop)
            else:
                buf = buf.index_copy(2, index, new)
            setattr(self, name, buf)
        elif isinstance(index, slice):
            buf[:, :, index].copy_(new)
        else:
            buf.index_copy_(2, index, new)
        return buf


class KVCache(_Cache):
    """Cache of every key and value of one attention layer, up to ``max_len`` tokens.

    Pass it to the same :class:`qkv.MultiHeadAttention` at each step of a self-attention
    sequence: ``mha(x_chunk, cache=cache, mask=qkv.causal)``. The chunk's queries are the
    *last* ``Lq`` of the ``Lk = cache.length + Lq`` positions, and masks and score_mods are
    evaluated at absolute positions, so decoding a sequence in chunks of any size (a long
    prefill, then one token at a time) gives the outputs of one pass over the whole sequence
    with the same mask, for any mask under which no query sees a later position
    (``qkv.causal``, ``qkv.sliding_window(n)``, causal document masks, ...). For
    ``qkv.causal``, 3 cached tokens and a chunk of 2 (rows = the new queries, columns = all 5
    keys)::

        1 1 1 1 0
        1 1 1 1 1

    A bool mask or bias *tensor* is taken as given, over the chunk's ``[Lq, Lk]``.

    Args:
        max_len: the most tokens the cache will hold. Buffers ``[B, Hkv, max_len, D]`` are
            allocated at the first call (batch size, dtype and device from that call); a
            call that would exceed ``max_len`` raises before computing anything.

    Example::

        >>> import torch, qkv
        >>> mha = qkv.MultiHeadAttention(64, 4, rope=True).eval()
        >>> x = torch.randn(1, 10, 64)
        >>> cache = qkv.KVCache(max_len=16)
        >>> with torch.no_grad():
        ...     full = mha(x, mask=qkv.causal)
        ...     steps = [mha(x[:, :6], cache=cache, mask=qkv.causal)]          # prefill
        ...     steps += [mha(x[:, i : i + 1], cache=cache, mask=qkv.causal) for i in range(6, 10)]
        >>> torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
        True
        >>> cache.length
        10
    """

    def __init__(self, max_len: int) -> None:
        super().__init__()
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0:
            raise ValueError(f"KVCache max_len must be a positive int, got {max_len!r}")
        self.max_len = max_len
        self._capacity = max_len

    def __repr__(self) -> str:
        return f"qkv.KVCache(max_len={self.max_len}, length={self.length})"

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens (e.g. to drop rejected speculative tokens, or
        to decode several continuations of one cached prompt). Nothing is copied."""
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"truncate length must be an int, got {type(length).__name__}")
        with self._claimed("be truncated"):
            if not 0 <= length <= self.length:
                raise ValueError(
                    f"truncate length must be in [0, {self.length}] (the cached tokens), got "
                    f"{length}"
                )
            self._length = length

    def _check_room(self, Lq: int) -> None:
        if self.length + Lq > self.max_len:
            raise ValueError(
                f"KVCache overflow: it holds {self.length} of max_len={self.max_len} tokens and "
                f"{Lq} more would need {self.length + Lq}; make a KVCache(max_len="
                f"{self.length + Lq}) or larger, use a SlidingWindowCache, or reset() it"
            )

    def _extend(
        self, k: Tensor, v: Tensor, mask: MaskLike, score_mod: ScoreLike, *, ordered: bool
    ) -> tuple[Tensor, Tensor, MaskLike, ScoreLike]:
        """Append ``k [B, Hkv, Lq, D]``, ``v`` and return what to attend to."""
        n, Lq = self.length, k.shape[2]
        Lk = n + Lq
        kb = self._write("_k", slice(n, Lk), k)
        vb = self._write("_v", slice(n, Lk), v)
        mask = mask_at(mask, n, 0, Lq, Lk)
        score_mod = score_at(score_mod, n, 0, Lq)
        return kb[:, :, :Lk], vb[:, :, :Lk], mask, score_mod  # [B, Hkv, Lk, D] views


class SlidingWindowCache(_Cache):
    """Ring buffer of the last ``window`` keys and values of one attention layer.

    Each query attends to the ``window`` most recent positions, itself included (Mistral's
    convention), at any sequence length, in memory of ``window`` tokens. Decoding through it
    equals one pass over the whole sequence with ``mask=qkv.sliding_window(window - 1)``. The
    window is enforced by the cache; a mask or score_mod you pass is applied on top at
    absolute positions (``mask=None``, ``qkv.causal`` and ``qkv.sliding_window(window - 1)``
    all give the same result). For ``window = 3`` on 5 positions::

        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0
        0 1 1 1 0
        0 0 1 1 1

    A single new token is written in place into slot ``position % window`` (no copy); a
    chunk of several tokens attends to the cached keys plus the chunk, then keeps its last
    ``window`` keys. Mask and bias *tensors* are refused (their key columns would refer to
    ring slots); use a mask_mod / score_mod. The buffers hold keys ``[B, Hkv, window, D]``
    and values ``[B, Hkv, window, Dv]``.

    Args:
        window: keys each query sees, itself included (>= 1).

    Example::

        >>> import torch, qkv
        >>> mha = qkv.MultiHeadAttention(32, 4).eval()
        >>> x = torch.randn(1, 12, 32)
        >>> cache = qkv.SlidingWindowCache(window=4)
        >>> with torch.no_grad():
        ...     full = mha(x, mask=qkv.sliding_window(3))
        ...     steps = [mha(x[:, i : i + 1], cache=cache) for i in range(12)]
        >>> torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
        True
    """

    def __init__(self, window: int) -> None:
        super().__init__()
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(
                f"SlidingWindowCache window must be a positive int (keys per query, itself "
                f"included), got {window!r}"
            )
        self.window = window
        self._capacity = window
        self._pending: tuple[Tensor, Tensor, Tensor] | None = None  # (slots, k, v) to write

    def __repr__(self) -> str:
        return f"qkv.SlidingWindowCache(window={self.window}, length={self.length})"

    def _check_step(self, layer: object, *, mask: object, score_mod: object, **step: Any) -> None:
        self._check_no_tensors(mask, score_mod)
        super()._check_step(layer, mask=mask, score_mod=score_mod, **step)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_pending"] = None  # what a failed step left over (a step in progress is refused)
        return state

    @staticmethod
    def _check_no_tensors(mask: object, score_mod: object) -> None:
        for name, obj in (("mask", mask), ("score_mod", score_mod)):
            if isinstance(obj, Tensor):
                raise TypeError(
                    f"a SlidingWindowCache cannot take a {name} tensor: its key columns would "
                    f"refer to ring-buffer slots, not positions; pass a callable evaluated at "
                    f"absolute positions, e.g. lambda b, h, q_idx, kv_idx: ..."
                )

    def _extend(
        self, k: Tensor, v: Tensor, mask: MaskLike, score_mod: ScoreLike, *, ordered: bool
    ) -> tuple[Tensor, Tensor, MaskLike, ScoreLike]:
        n, Lq, W = self.length, k.shape[2], self.window
        self._pending = None  # left over from a call that failed
        if Lq == 1 and not ordered:
            return self._extend_one(k, v, mask, score_mod)
        assert self._k is not None and self._v is not None
        # Cached keys oldest first: positions n-m .. n-1, then the chunk: n .. n+Lq-1.
        m = min(n, W)
        start = n % W
        if n <= W:
            old_k, old_v = self._k[:, :, :m], self._v[:, :, :m]  # [B, Hkv, m, D]
        else:
            old_k = torch.cat((self._k[:, :, start:], self._k[:, :, :start]), dim=2)
            old_v = torch.cat((self._v[:, :, start:], self._v[:, :, :start]), dim=2)
        k_all = torch.cat((old_k, k), dim=2)  # [B, Hkv, m + Lq, D]
        v_all = torch.cat((old_v, v), dim=2)  # [B, Hkv, m + Lq, Dv]
        Lk = m + Lq
        # Buffer offsets j - i for the window [q_abs - W + 1, q_abs]: kv_abs - q_abs = j - i - m.
        window = band(m - W + 1, m, f"the last {W} positions").mask_mod
        user = mask_at(mask, n, n - m, Lq, Lk)
        # A band under the window stays one band: qkv's classification intersects them.
        full_mask = window if user is None else and_masks(window, user)  # type: ignore[arg-type]
        score_mod = score_at(score_mod, n, n - m, Lq)
        # The newest `keep` keys stay in the ring. They are written after the attention call
        # (in _advance): writing now would evict keys this chunk's queries may still need if
        # the call fails (say, a mask_mod raises) and is retried.
        keep = min(Lq, W)
        slots = torch.arange(n + Lq - keep, n + Lq, device=k.device) % W
        self._pending = (slots, k[:, :, Lq - keep :], v[:, :, Lq - keep :])
        return k_all, v_all, full_mask, score_mod

    def _advance(self, n: int) -> None:
        if self._pending is not None:
            slots, k, v = self._pending
            self._pending = None
            self._write("_k", slots, k)
            self._write("_v", slots, v)
        super()._advance(n)

    def _extend_one(
        self, k: Tensor, v: Tensor, mask: MaskLike, score_mod: ScoreLike
    ) -> tuple[Tensor, Tensor, MaskLike, ScoreLike]:
        """One new token at position ``n``: write it over slot ``n % W`` (which held position
        ``n - W``, just out of the window) and attend to the filled slots in ring order."""
        n, W = self.length, self.window
        slot = n % W
        kb = self._write("_k", slice(slot, slot + 1), k)
        vb = self._write("_v", slice(slot, slot + 1), v)
        if n < W:  # not yet wrapped: slot s holds position s
            Lk = n + 1
            return (
                kb[:, :, :Lk],
                vb[:, :, :Lk],
                mask_at(mask, n, 0, 1, Lk),
                score_at(score_mod, n, 0, 1),
            )
        ring = RingPositions(n, W)
        kind = mask_kind(mask)
        if not band_covers(kind, -(W - 1), 0) and not kind.is_none:
            mask = mask_at(kind.mask_mod, n, ring, 1, W)
        else:  # every slot holds a position in [n - W + 1, n], all visible
            mask = None
        return kb, vb, mask, score_at(score_mod, n, ring, 1)

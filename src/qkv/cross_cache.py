"""A static cache of cross-attention keys and values, for encoder–decoder decoding.

An encoder–decoder's decoder (Whisper, T5, BART, ...) cross-attends to the same encoder output
at every step. Without a cache each step re-projects that whole context through ``k_proj`` and
``v_proj``: for Whisper that is 1500 audio frames per layer per token, more work than the rest
of the step. :class:`CrossKVCache` keeps the projected keys and values of one layer, made at the
first step, and every later step reuses them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import inspect
from .functional import attention
from .typing import MaskLike, ScoreLike

Tensor = torch.Tensor

__all__ = ["CrossKVCache"]


class CrossKVCache:
    """The keys and values of a fixed context, projected once by one cross-attention layer.

    Pass it to the same :class:`qkv.MultiHeadAttention` at every decoding step, with the same
    context tensor: ``mha(x_step, context, cache=cache)``. The first call projects ``context``
    ``[B, Lk, kdim]`` into keys and values ``[B, Hkv, Lk, D]`` (after ``k_norm``, and RoPE at
    positions ``0..Lk-1`` as a call without a cache applies it) and keeps them; later calls only
    project their queries. Every call equals ``mha(x_step, context)`` without the cache, masks,
    score_mods and ``need_weights`` included (queries are at positions ``0..Lq-1`` of the step,
    as without a cache: cross-attention has no causal order between the two sequences).

    A call with another context (other memory, shape or strides, or the same tensor written in
    place since) raises; ``reset()`` to start a new one. Under autograd the stored keys carry
    their graph: a backward through several steps reaches the projections once per step.

    Example::

        >>> import torch, qkv
        >>> mha = qkv.MultiHeadAttention(64, 4).eval()
        >>> context, x = torch.randn(1, 50, 64), torch.randn(1, 3, 64)
        >>> cache = qkv.CrossKVCache()
        >>> with torch.no_grad():
        ...     steps = [mha(x[:, i : i + 1], context, cache=cache) for i in range(3)]
        ...     full = mha(x, context)
        >>> torch.allclose(torch.cat(steps, dim=1), full, atol=1e-6)
        True
        >>> cache.shape                              # [B, Hkv, Lk, D]
        torch.Size([1, 4, 50, 16])
    """

    def __init__(self) -> None:
        self._k: Tensor | None = None  # [B, Hkv, Lk, D]
        self._v: Tensor | None = None  # [B, Hkv, Lk, Dv]
        self._context: tuple[Any, ...] | None = None  # what identifies the context tensor
        self._owner: weakref.ref[Any] | None = None  # the layer's LayerKey

    @property
    def shape(self) -> torch.Size | None:
        """``[B, Hkv, Lk, D]`` of the stored keys, or ``None`` while empty."""
        return None if self._k is None else self._k.shape

    def reset(self) -> None:
        """Forget the stored keys and values (the next call projects its context again)."""
        self._k = self._v = None
        self._context = self._owner = None

    def __repr__(self) -> str:
        return f"qkv.CrossKVCache(shape={None if self.shape is None else list(self.shape)})"

    def _keys_values(
        self, layer: Any, given: Tensor, xk: Tensor, xv: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The keys and values of context ``xk``/``xv`` ``[B, Lk, width]`` (``given``: the
        context tensor as the caller passed it) for the module ``layer``, projected on the
        first call and reused after."""
        if self._k is not None and self._v is not None:
            owner = self._owner() if self._owner is not None else None
            if owner is not None and owner is not layer._cache_key:
                raise ValueError(
                    "this CrossKVCache holds the keys/values of another attention layer; a "
                    "cache belongs to one layer: make one per layer, or reset() it first"
                )
            if _identity(given) != self._context:
                raise ValueError(
                    f"this CrossKVCache holds the keys/values {list(self._k.shape)} of another "
                    f"context (a different tensor, or the same one changed in place); pass the "
                    f"same context at every step, or reset() the cache for a new one"
                )
            return self._k, self._v
        B, Lk, _ = xk.shape
        Hkv, D = layer.n_kv_heads, layer.head_dim
        k = layer.k_proj(xk).view(B, Lk, Hkv, D).transpose(1, 2)  # [B, Hkv, Lk, D]
        v = layer.v_proj(xv).view(B, Lk, Hkv, D).transpose(1, 2)  # [B, Hkv, Lk, D]
        if layer.k_norm is not None:
            k = layer.k_norm(k)
        if layer.rope is not None:
            k = layer.rope(k, offset=0)
        # Stored contiguous, each head's keys one block: every later step reads them all, and
        # the decode kernel read Whisper's [1, 6, 1500, 64] head-strided views (rows 256 bytes
        # apart by 1536) at 1.2-1.3 ms a call against 0.75-0.8 ms contiguous (one thread,
        # equal outputs); the copy is made once per context.
        k, v = k.contiguous(), v.contiguous()
        self._k, self._v = k, v
        self._context, self._owner = _identity(given), weakref.ref(layer._cache_key)
        return k, v

    def _attend(
        self,
        layer: Any,
        x_q: Tensor,
        x_kv: Tensor | tuple[Tensor, Tensor] | None,
        mask: MaskLike,
        score_mod: ScoreLike,
        need_weights: bool,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``layer(x_q, x_kv, ...)`` with this cache: what ``MultiHeadAttention.forward`` runs
        when it is given a CrossKVCache."""
        if x_kv is None:
            raise ValueError(
                "a CrossKVCache is for cross-attention: pass the context as x_kv at every "
                "step (the same tensor; it is projected once)"
            )
        xq, xk, xv = layer._check_inputs(x_q, x_kv)
        if not isinstance(need_weights, bool):
            raise TypeError(f"need_weights must be True or False, got {type(need_weights)}")
        unbatched = xq.ndim == 2
        if unbatched:
            xq, xk, xv = xq[None], xk[None], xv[None]  # [1, L, width]
        B, Lq, _ = xq.shape
        H, D = layer.n_heads, layer.head_dim
        given = x_kv[0] if isinstance(x_kv, (tuple, list)) else x_kv  # the tensor as passed
        k, v = self._keys_values(layer, given, xk, xv)
        q = layer.q_proj(xq).view(B, Lq, H, D).transpose(1, 2)  # [B, H, Lq, D]
        if layer.q_norm is not None:
            q = layer.q_norm(q)
        if layer.rope is not None:
            q = layer.rope(q, offset=0)
        p_drop = layer.dropout if layer.training else 0.0
        res = attention(
            q, k, v, mask=mask, score_mod=score_mod, dropout_p=p_drop, return_lse=need_weights
        )
        weights: Tensor | None = None
        if need_weights:
            o, lse = res  # [B, H, Lq, D], [B, H, Lq]
            weights = inspect.weights(q, k, lse=lse.detach(), mask=mask, score_mod=score_mod)
        else:
            assert isinstance(res, Tensor)
            o = res
        out = layer.out_proj(o.transpose(1, 2).reshape(B, Lq, H * D))  # [B, Lq, d_model]
        if unbatched:
            out = out[0]  # [Lq, d_model]
            weights = weights[0] if weights is not None else None  # [H, Lq, Lk]
        if weights is not None:
            return out, weights
        return out


def _identity(t: Tensor) -> tuple[Any, ...]:
    """Same memory, same view and not written since (a view made again each step, such as
    ``enc[0]``, counts as the same context)."""
    version = None if t.is_inference() else t._version  # inference tensors keep no counter
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, version)

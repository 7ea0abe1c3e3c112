"""``qkv.MultiHeadAttention``: projections around one batched :func:`qkv.attention` call.

Multi-head attention is *how* attention is computed, not *between what*: the same module does
self-attention (``mha(x)``) and cross-attention (``mha(x, context)``) depending on what it is
given. Heads are a tensor dimension (``[B, H, L, D]``), never a Python loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import _recording, _torch_mha, inspect
from ._cache_state import LayerKey
from .cache import KVCache, SlidingWindowCache
from .cross_cache import CrossKVCache
from .functional import attention
from .rope import RotaryEmbedding
from .typing import MaskLike, ScoreLike

Tensor = torch.Tensor

__all__ = ["MultiHeadAttention"]


def _check_pos_int(name: str, val: object) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return val


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class MultiHeadAttention(nn.Module, _recording.AttentionLayer):
    """Multi-head attention: self, causal or cross, with GQA, RoPE and a KV cache.

    Computes, with ``H = n_heads``, ``D = d_model // n_heads`` and ``Hkv = n_kv_heads``::

        q = q_proj(x_q)   viewed as [B, H,   Lq, D]
        k = k_proj(x_kv)  viewed as [B, Hkv, Lk, D]     (x_kv = x_q for self-attention)
        v = v_proj(x_kv)  viewed as [B, Hkv, Lk, D]
        out = out_proj(qkv.attention(q, k, v, mask=mask, score_mod=score_mod)  as [B, Lq, H*D])

    Args:
        d_model: width of the queries and of the output.
        n_heads: query heads ``H``; ``d_model`` must be a multiple of it.
        n_kv_heads: key/value heads ``Hkv`` (default ``n_heads``). ``n_heads % n_kv_heads == 0``;
            fewer K/V heads is grouped-query attention with smaller K/V projections, and
            ``n_kv_heads=1`` is multi-query attention.
        kdim, vdim: width of the context that keys and values are projected from (default
            ``d_model``), e.g. an encoder of another width in cross-attention.
        bias: add a bias to all four projections (default ``False``).
        dropout: dropout on the attention probabilities, in training mode only.
        rope: ``None``, a :class:`qkv.RotaryEmbedding` (rotating up to ``D`` features), or
            ``True`` for ``RotaryEmbedding(D)``. Applied to q and k at their absolute positions
            (under a KV cache too), after ``qk_norm``.
        qk_norm: RMS-normalise q and k over each head's ``D`` features (learnable scale,
            submodules ``q_norm``/``k_norm``) before RoPE and the dot product.
        device, dtype: where and in which dtype to create the parameters.

    The parameters are the ``nn.Linear`` submodules ``q_proj``, ``k_proj``, ``v_proj`` and
    ``out_proj`` (``state_dict`` keys ``q_proj.weight``, ``q_proj.bias``, ...).

    Example::

        >>> import torch, qkv
        >>> mha = qkv.MultiHeadAttention(64, 8, n_kv_heads=2)
        >>> x, ctx = torch.randn(2, 10, 64), torch.randn(2, 7, 64)
        >>> mha(x, mask=qkv.causal).shape            # causal self-attention
        torch.Size([2, 10, 64])
        >>> out, w = mha(x, ctx, need_weights=True)  # cross-attention, with the weights
        >>> w.shape                                  # [B, H, Lq, Lk]
        torch.Size([2, 8, 10, 7])
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = False,
        dropout: float = 0.0,
        rope: RotaryEmbedding | bool | None = None,
        qk_norm: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d_model = _check_pos_int("d_model", d_model)
        n_heads = _check_pos_int("n_heads", n_heads)
        if d_model % n_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}; each head gets "
                f"d_model // n_heads features, so pick n_heads in {_divisors(d_model)}"
            )
        n_kv_heads = n_heads if n_kv_heads is None else _check_pos_int("n_kv_heads", n_kv_heads)
        if n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}; each key/value "
                f"head serves n_heads // n_kv_heads query heads, so pick n_kv_heads in "
                f"{_divisors(n_heads)}"
            )
        kdim = d_model if kdim is None else _check_pos_int("kdim", kdim)
        vdim = d_model if vdim is None else _check_pos_int("vdim", vdim)
        for name, flag in (("bias", bias), ("qk_norm", qk_norm)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {type(flag).__name__}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise TypeError(f"dropout must be a float in [0, 1), got {type(dropout).__name__}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}; 0.0 turns it off")
        head_dim = d_model // n_heads
        if rope is True:
            if head_dim % 2:
                raise ValueError(
                    f"RoPE rotates features in pairs, but head_dim = d_model // n_heads = "
                    f"{d_model} // {n_heads} = {head_dim} is odd; choose d_model and n_heads "
                    f"with an even quotient"
                )
            rope = RotaryEmbedding(head_dim)
        elif rope is False:
            rope = None
        elif rope is not None and not isinstance(rope, RotaryEmbedding):
            raise TypeError(
                f"rope must be None, True or a qkv.RotaryEmbedding, got {type(rope).__name__}"
            )
        if rope is not None and rope.dim > head_dim:
            raise ValueError(
                f"rope rotates {rope.dim} features but head_dim = d_model // n_heads = "
                f"{d_model} // {n_heads} = {head_dim}; use qkv.RotaryEmbedding({head_dim}) or "
                f"smaller"
            )

        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim, self.kdim, self.vdim = head_dim, kdim, vdim
        self.dropout = float(dropout)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias, **fk)
        self.k_proj = nn.Linear(kdim, n_kv_heads * head_dim, bias=bias, **fk)
        self.v_proj = nn.Linear(vdim, n_kv_heads * head_dim, bias=bias, **fk)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias, **fk)
        self.rope = rope
        # Qwen3/OLMo-2 style: one learnable scale over the head dim, shared by the heads.
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6, **fk) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6, **fk) if qk_norm else None
        # This layer in its KV caches (a cache saved or copied with it keeps the copy).
        self._cache_key = LayerKey()

    def __setstate__(self, state: dict[str, Any]) -> None:  # saved before layers had keys?
        super().__setstate__(state)
        self.__dict__.setdefault("_cache_key", LayerKey())

    def extra_repr(self) -> str:
        s = f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}"
        if self.kdim != self.d_model or self.vdim != self.d_model:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.dropout:
            s += f", dropout={self.dropout}"
        return s

    # ------------------------------------------------------------------------------ checks

    def _check_input(self, name: str, x: object, width: int, what: str) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim not in (2, 3):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; expected [B, L, {what}={width}] or "
                f"unbatched [L, {what}={width}]"
            )
        if x.shape[-1] != width:
            raise ValueError(
                f"{name} has width {x.shape[-1]} (shape {tuple(x.shape)}) but this module "
                f"expects {what}={width}"
            )
        wdtype = self.q_proj.weight.dtype
        if x.dtype != wdtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but the module's parameters are {wdtype}; "
                f"convert with {name}.to({wdtype}) or module.to({x.dtype})"
            )
        return x

    def _check_inputs(self, x_q: object, x_kv: object) -> tuple[Tensor, Tensor, Tensor]:
        """``(x_q, x_k, x_v)`` as given (2-D or 3-D), checked against the module's widths."""
        xq = self._check_input("x_q", x_q, self.d_model, "d_model")
        if x_kv is None:
            if self.kdim != self.d_model or self.vdim != self.d_model:
                raise ValueError(
                    f"self-attention (x_kv=None) projects keys/values from x_q of width "
                    f"d_model={self.d_model}, but this module has kdim={self.kdim}, "
                    f"vdim={self.vdim}; pass the context as x_kv"
                )
            return xq, xq, xq
        if isinstance(x_kv, (tuple, list)):
            if len(x_kv) != 2:
                raise ValueError(f"x_kv as a pair must be (x_k, x_v), got {len(x_kv)} tensors")
            xk = self._check_input("x_kv[0] (keys)", x_kv[0], self.kdim, "kdim")
            xv = self._check_input("x_kv[1] (values)", x_kv[1], self.vdim, "vdim")
            if xk.shape[:-1] != xv.shape[:-1]:
                raise ValueError(
                    f"x_k of shape {tuple(xk.shape)} and x_v of shape {tuple(xv.shape)} must "
                    f"share their batch and length (one value per key)"
                )
        else:
            if self.kdim != self.vdim:
                raise ValueError(
                    f"this module has kdim={self.kdim} != vdim={self.vdim}, so keys and values "
                    f"come from different tensors: pass x_kv=(x_k, x_v)"
                )
            xk = xv = self._check_input("x_kv", x_kv, self.kdim, "kdim")
        if xk.ndim != xq.ndim:
            raise ValueError(
                f"x_q has shape {tuple(xq.shape)} but x_kv has shape {tuple(xk.shape)}; both "
                f"batched [B, L, width] or both unbatched [L, width]"
            )
        if xq.ndim == 3 and xk.shape[0] != xq.shape[0]:
            raise ValueError(
                f"x_q has batch size {xq.shape[0]} but x_kv has {xk.shape[0]}; they must match"
            )
        if xk.device != xq.device:
            raise ValueError(f"x_q is on {xq.device} but x_kv is on {xk.device}")
        return xq, xk, xv

    # ----------------------------------------------------------------------------- forward

    def forward(
        self,
        x_q: Tensor,
        x_kv: Tensor | tuple[Tensor, Tensor] | None = None,
        *,
        mask: MaskLike = None,
        score_mod: ScoreLike = None,
        cache: KVCache | SlidingWindowCache | CrossKVCache | None = None,
        need_weights: bool = False,
        context_parallel: object = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x_q`` to ``x_kv`` (or to ``x_q`` itself when ``x_kv`` is None).

        Args:
            x_q: ``[B, Lq, d_model]`` or unbatched ``[Lq, d_model]``.
            x_kv: ``None`` for self-attention (``mha(x)`` equals ``mha(x, x)``); the context
                ``[B, Lk, kdim]`` for cross-attention; or a pair ``(x_k [B, Lk, kdim],
                x_v [B, Lk, vdim])`` when keys and values come from different tensors.
            mask: as in :func:`qkv.attention` (True = may attend), over ``[B, H, Lq, Lk]``.
            score_mod: as in :func:`qkv.attention`.
            cache: a :class:`qkv.KVCache` or :class:`qkv.SlidingWindowCache` for incremental
                self-attention decoding: the new keys/values are appended and the queries
                attend to everything cached. Masks and score_mods then see *absolute*
                positions (see :class:`qkv.KVCache`). For cross-attention, a
                :class:`qkv.CrossKVCache` projects the context once and reuses it.
            need_weights: also return the attention weights ``[B, H, Lq, Lk]``: the softmax
                probabilities, rebuilt exactly from the lse of the same :func:`qkv.attention`
                call (:func:`qkv.inspect.weights`), so the fast backend still computes the
                output and :func:`qkv.inspect.record` sees the call. Dense by definition:
                ``O(B·H·Lq·Lk)`` memory. In training with ``dropout > 0`` they are the
                probabilities *before* dropout (rows sum to 1), whereas
                ``torch.nn.MultiheadAttention`` returns the dropped-out, rescaled weights it
                multiplied ``v`` with.
            context_parallel: ``True``, a process group or a ``qkv.distributed.ContextParallel``:
                ``x_q`` is this rank's shard of a split sequence (``qd.shard(x, dim=1)``) and
                attention runs over the whole sequence, by ``qkv.distributed.attention``.

        Returns:
            ``out [B, Lq, d_model]`` (``[Lq, d_model]`` unbatched), or ``(out, weights)``.
        """
        if isinstance(cache, CrossKVCache):  # the same context every step: projected once
            return cache._attend(self, x_q, x_kv, mask, score_mod, need_weights)
        xq, xk, xv = self._check_inputs(x_q, x_kv)
        if not isinstance(need_weights, bool):
            raise TypeError(f"need_weights must be True or False, got {type(need_weights)}")
        unbatched = xq.ndim == 2
        if unbatched:
            xq, xk, xv = xq[None], xk[None], xv[None]  # [1, L, width]
        B, Lq, _ = xq.shape
        Lk = xk.shape[1]
        cp = None
        if context_parallel is not None:  # imported here so `import qkv` stays light
            from .distributed.module import bind

            cp = bind(context_parallel, self, xq, x_kv=x_kv, cache=cache, need_weights=need_weights)
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if cache is not None:
            if x_kv is not None:
                raise ValueError(
                    "a KV cache is for self-attention decoding (x_kv=None); for cross-attention "
                    "pass a qkv.CrossKVCache (the context projected once)"
                )
            w = self.k_proj.weight
            # The cache is this step's alone until _end_step below (others are refused).
            cache._check_step(
                self._cache_key,
                B=B,
                Hkv=Hkv,
                D=D,
                dtype=w.dtype,
                device=w.device,
                Lq=Lq,
                mask=mask,
                score_mod=score_mod,
            )

        try:
            q = self.q_proj(xq).view(B, Lq, H, D).transpose(1, 2)  # [B, H, Lq, D]
            k = self.k_proj(xk).view(B, Lk, Hkv, D).transpose(1, 2)  # [B, Hkv, Lk, D]
            v = self.v_proj(xv).view(B, Lk, Hkv, D).transpose(1, 2)  # [B, Hkv, Lk, D]
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            pos = cache.length if cache is not None else 0
            if self.rope is not None:
                at: dict[str, Any] = {"offset": pos} if cp is None else {"positions": cp.positions}
                q, k = self.rope(q, **at), self.rope(k, **at)
            if cache is not None:
                k, v, mask, score_mod = cache._extend(k, v, mask, score_mod, ordered=need_weights)

            p_drop = self.dropout if self.training else 0.0
            weights: Tensor | None = None
            res = (attention if cp is None else cp.attention)(
                q, k, v, mask=mask, score_mod=score_mod, dropout_p=p_drop, return_lse=need_weights
            )
            if need_weights:
                o, lse = res  # [B, H, Lq, D], [B, H, Lq]
                # The rows are renormalised (exp(s - lse) / its sum), so lse cancels out of the
                # weights and their gradient: it is only the stabiliser, and needs no gradient.
                weights = inspect.weights(q, k, lse=lse.detach(), mask=mask, score_mod=score_mod)
            else:
                assert isinstance(res, Tensor)
                o = res
            if cache is not None:
                cache._advance(Lq)
        finally:
            if cache is not None:
                cache._end_step()  # a step that raised frees the cache as well

        o = o.transpose(1, 2).reshape(B, Lq, H * D)  # [B, Lq, H*D]
        out = self.out_proj(o)  # [B, Lq, d_model]
        if unbatched:
            out = out[0]  # [Lq, d_model]
            weights = weights[0] if weights is not None else None  # [H, Lq, Lk]
        return (out, weights) if weights is not None else out  # weights iff need_weights

    # ------------------------------------------------------------------ torch interoperation

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """A qkv module with the weights of ``torch.nn.MultiheadAttention`` ``m``.

        Packed (``in_proj_weight``) and separate (``q/k/v_proj_weight``, when ``kdim``/``vdim``
        differ from ``embed_dim``) in-projections, biases and dropout are copied; parameters
        are copies (not shared) on ``m``'s device and dtype. ``add_bias_kv`` and
        ``add_zero_attn`` have no qkv equivalent and are refused.

        qkv modules are always batch-first: for a torch module with ``batch_first=False``,
        transpose its ``[L, B, E]`` inputs, ``qkv_mha(x.transpose(0, 1))``.

        Masks: torch's boolean masks mean True = *blocked*; qkv's mean True = *may attend*.
        Translate them so::

            torch: m(q, k, v, key_padding_mask=kpm)        kpm [B, Lk] bool, True = pad
            qkv:   mha(q, kv, mask=~kpm[:, None, None, :])   (a float kpm: score_mod=kpm[...])

            torch: m(q, k, v, attn_mask=am)                  am [Lq, Lk] or [B*H, Lq, Lk]
            qkv:   mha(q, kv, mask=~am)                      bool; [B*H, ...] -> view(B, H, Lq, Lk)
                   mha(q, kv, score_mod=am)                  float am is an additive bias

            torch: m(q, k, v, attn_mask=am, is_causal=True)  (am = the causal mask)
            qkv:   mha(q, kv, mask=qkv.causal)

        torch's ``need_weights=True, average_attn_weights=False`` weights ``[B, H, Lq, Lk]``
        equal qkv's ``need_weights=True`` weights (``.mean(1)`` gives torch's default average)
        without dropout; in training with dropout torch returns them after dropout, qkv before.

        Example::

            >>> import torch, qkv
            >>> t = torch.nn.MultiheadAttention(32, 4, batch_first=True)
            >>> mha = qkv.MultiHeadAttention.from_torch(t)
            >>> x = torch.randn(2, 5, 32)
            >>> torch.allclose(mha(x), t(x, x, x)[0], atol=1e-6)
            True
        """
        new = cls(**_torch_mha.constructor_args(m))
        _torch_mha.copy_from_torch(m, new)
        return new.train(m.training)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention`` with this module's weights (copies).

        Only for the configurations torch's module can express: ``n_kv_heads == n_heads``, no
        RoPE and no qk_norm. Raises ``ValueError`` naming the option otherwise. Masks translate
        as described in :meth:`from_torch`.
        """
        return _torch_mha.to_torch(self, batch_first=batch_first)

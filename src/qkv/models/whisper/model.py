"""Whisper's encoder–decoder (Radford et al. 2022) with every attention a
:class:`qkv.MultiHeadAttention`.

The audio encoder: two convolutions (the second with stride 2: 3000 mel frames → 1500
positions of 20 ms), sinusoidal positions, pre-norm blocks of self-attention and a GELU MLP,
a final LayerNorm::

    x = gelu(conv2(gelu(conv1(mel)))) + positions                        # [B, 1500, d]
    x = x + self_attention(norm(x));  x = x + mlp(norm(x))                # per layer

The text decoder: token embedding + learned positions, pre-norm blocks of causal
self-attention, cross-attention to the encoder output, and a GELU MLP, a final LayerNorm, and
logits from the token embedding (tied)::

    x = x + self_attention(norm(x), mask=qkv.causal)                      # [B, L, d]
    x = x + cross_attention(norm(x), audio)                               # queries: text
    x = x + mlp(norm(x));  logits = norm(x) @ embedding.T                 # [B, L, vocab]

The modules hold parameters only; :func:`load_ct2` fills them from a CTranslate2 folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ...cache import KVCache
from ...cross_cache import CrossKVCache
from ...functional import attention
from ...masks import causal
from ...modules import MultiHeadAttention
from ..int8 import Int8Linear

Tensor = torch.Tensor

__all__ = ["WhisperConfig", "WhisperDecoder", "WhisperEncoder"]


@dataclass(frozen=True)
class WhisperConfig:
    """The sizes of a Whisper checkpoint (tiny.en: 80, 384, 4, 6, 4, 6, 51864)."""

    n_mels: int  # mel bins per frame
    d_model: int  # width of both stacks
    n_audio_layers: int
    n_audio_heads: int
    n_text_layers: int
    n_text_heads: int
    vocab_size: int
    n_audio_ctx: int = 1500  # encoder positions (30 s at 20 ms)
    n_text_ctx: int = 448  # decoder positions

    @property
    def n_layers(self) -> int:
        """Attention layers of the decoder (what ``qkv explain`` iterates over)."""
        return self.n_text_layers

    @property
    def n_heads(self) -> int:
        return self.n_text_heads


class _MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)  # [..., 4d]
        if torch.is_grad_enabled():
            return self.fc2(F.gelu(h))
        return self.fc2(torch.ops.aten.gelu_(h))  # in place: no second [1500, 4d] buffer


class EncoderLayer(nn.Module):
    """One pre-norm encoder block; ``attention`` is a :class:`qkv.MultiHeadAttention`."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d)
        self.attention = MultiHeadAttention(d, n_heads, bias=True)
        self.mlp_norm = nn.LayerNorm(d)
        self.mlp = _MLP(d)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attn_norm(x))  # [B, 1500, d]
        return x + self.mlp(self.mlp_norm(x))

    def forward_(self, x: Tensor) -> Tensor:
        """:meth:`forward` adding into ``x`` in place (the same sums, no new buffers), for
        inference only."""
        x.add_(self.attention(self.attn_norm(x)))
        return x.add_(self.mlp(self.mlp_norm(x)))


class DecoderLayer(nn.Module):
    """One pre-norm decoder block: ``self_attention`` (causal) and ``cross_attention`` (to the
    audio), both :class:`qkv.MultiHeadAttention`."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.self_norm = nn.LayerNorm(d)
        self.self_attention = MultiHeadAttention(d, n_heads, bias=True)
        self.cross_norm = nn.LayerNorm(d)
        self.cross_attention = MultiHeadAttention(d, n_heads, bias=True)
        self.mlp_norm = nn.LayerNorm(d)
        self.mlp = _MLP(d)

    def forward(
        self,
        x: Tensor,
        audio: Tensor,
        *,
        cache: KVCache | None = None,
        cross_cache: CrossKVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``x [B, L, d]``, ``audio [B, 1500, d]`` → ``(x [B, L, d], cross-attention weights
        [B, H, L, 1500] or None)``."""
        x = x + self.self_attention(self.self_norm(x), mask=causal, cache=cache)
        h = self.cross_norm(x)
        w: Tensor | None = None
        if need_weights:
            a, w = self.cross_attention(h, audio, cache=cross_cache, need_weights=True)
        else:
            a = self.cross_attention(h, audio, cache=cross_cache)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), w


class WhisperEncoder(nn.Module):
    """Log-mel features ``[B, n_mels, 3000]`` → audio states ``[B, 1500, d]``;
    ``layers[i].attention`` is layer ``i``'s :class:`qkv.MultiHeadAttention`."""

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.n_mels, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.positions: Tensor
        self.register_buffer("positions", torch.zeros(config.n_audio_ctx, d))
        self.layers = nn.ModuleList(
            EncoderLayer(d, config.n_audio_heads) for _ in range(config.n_audio_layers)
        )
        self.norm = nn.LayerNorm(d)

    def forward(self, mel: Tensor) -> Tensor:
        gelu = F.gelu if torch.is_grad_enabled() else torch.ops.aten.gelu_
        x = gelu(self.conv2(gelu(self.conv1(mel))))  # [B, d, 1500]
        x = x.transpose(1, 2) + self.positions  # [B, 1500, d]: a new tensor, ours to update
        for layer in cast("list[EncoderLayer]", self.layers):
            # without autograd the residual stream is updated in place: no new [B, 1500, d]
            # buffers (the encoder measured 2% faster on one thread, outputs bit-identical)
            x = layer(x) if torch.is_grad_enabled() else layer.forward_(x)
        return self.norm(x)


class WhisperDecoder(nn.Module):
    """Token ids ``[B, L]`` and audio states ``[B, 1500, d]`` → logits ``[B, L, vocab]``;
    ``layers[i].self_attention`` and ``layers[i].cross_attention`` are layer ``i``'s
    :class:`qkv.MultiHeadAttention` modules. The logits are the final states times the token
    embedding (tied), as in the checkpoint."""

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d = config.d_model
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, d)
        self.positions: Tensor
        self.register_buffer("positions", torch.zeros(config.n_text_ctx, d))
        self.layers = nn.ModuleList(
            DecoderLayer(d, config.n_text_heads) for _ in range(config.n_text_layers)
        )
        self.norm = nn.LayerNorm(d)

    def new_caches(self) -> tuple[list[KVCache], list[CrossKVCache]]:
        """One self-attention :class:`qkv.KVCache` (the whole text context) and one
        :class:`qkv.CrossKVCache` per layer, for decoding one window."""
        n = self.config.n_text_layers
        return [KVCache(self.config.n_text_ctx) for _ in range(n)], [
            CrossKVCache() for _ in range(n)
        ]

    def states(
        self,
        ids: Tensor,
        audio: Tensor,
        *,
        caches: tuple[list[KVCache], list[CrossKVCache]] | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """The final (normalised) states ``[B, L, d]`` of ``ids`` continuing the cached ones,
        and each layer's cross-attention weights ``[B, H, L, 1500]`` if asked."""
        start = caches[0][0].length if caches is not None else 0
        x = self.embed(ids) + self.positions[start : start + ids.shape[1]]  # [B, L, d]
        maps: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            cache, cross = (caches[0][i], caches[1][i]) if caches is not None else (None, None)
            x, w = layer(x, audio, cache=cache, cross_cache=cross, need_weights=need_weights)
            if w is not None:
                maps.append(w)
        return self.norm(x), maps

    def can_step(self) -> bool:
        """Whether :meth:`step` may stand in for :meth:`states` on one token: inference
        (no autograd) and no module hooks anywhere in the decoder, nor global ones
        (``qkv.inspect.record`` hooks the attention modules: a recorded run takes
        :meth:`states`, so that every call is seen as its module's)."""
        if torch.is_grad_enabled() or _global_hooks():
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self.modules())

    def step(
        self, token: int, audio: Tensor, caches: tuple[list[KVCache], list[CrossKVCache]]
    ) -> Tensor:
        """The final state ``[1, 1, d]`` of one more token after the cached ones, as
        ``states(torch.tensor([[token]]), audio, caches=caches)[0]``, with the decoder's
        Python per layer cut down for greedy decoding (the module calls and their checks cost
        ~1-2 ms of a ~15 ms token on one thread): the same qkv caches (filled by a
        :meth:`states` call first, the prompt) and :func:`qkv.attention` on them, the
        self-attention's q/k/v as one product over their weights concatenated once
        (:meth:`_fused`), layer norms and linears called directly. Only where
        :meth:`can_step`."""
        selfs, crosses = caches
        n = selfs[0].length
        d = self.config.d_model
        x = (self.embed.weight[token] + self.positions[n]).view(1, 1, d)
        layers = cast("list[DecoderLayer]", self.layers)
        for layer, cache, cross, qkv_proj in zip(
            layers, selfs, crosses, self._fused(), strict=True
        ):
            a, c, m = layer.self_attention, layer.cross_attention, layer.mlp
            H, D = a.n_heads, a.head_dim
            h = _norm(layer.self_norm, x)
            qkv_ = qkv_proj.forward(h) if isinstance(qkv_proj, Int8Linear) else qkv_proj(h)
            q, k, v = qkv_.view(3, 1, H, 1, D)
            kb, vb, ck, cv = cache._k, cache._v, cross._k, cross._v
            assert kb is not None and vb is not None and ck is not None and cv is not None
            kb[:, :, n].copy_(k[:, :, 0])
            vb[:, :, n].copy_(v[:, :, 0])
            # one query at the last position: qkv.causal lets it see every cached key
            o = cast("Tensor", attention(q, kb[:, :, : n + 1], vb[:, :, : n + 1]))
            x = x + _linear(a.out_proj, o.view(1, 1, d))
            q = _linear(c.q_proj, _norm(layer.cross_norm, x)).view(1, H, 1, D)
            o = cast("Tensor", attention(q, ck, cv))
            x = x + _linear(c.out_proj, o.view(1, 1, d))
            h = _linear(m.fc1, _norm(layer.mlp_norm, x))
            x = x + _linear(m.fc2, torch.ops.aten.gelu_(h))
        for cache in selfs:
            cache._advance(1)
        return _norm(self.norm, x)

    def _fused(self) -> list[Callable[[Tensor], Tensor]]:
        """Each layer's self-attention ``q/k/v`` projection as one product ``[d] -> [3d]``
        (weights ``[3d, d]`` and biases ``[3d]`` concatenated; an :class:`Int8Linear` of the
        three when they are int8), made again when a weight moves or is written."""
        lins: list[nn.Module] = [
            lin
            for layer in cast("list[DecoderLayer]", self.layers)
            for lin in (
                layer.self_attention.q_proj,
                layer.self_attention.k_proj,
                layer.self_attention.v_proj,
            )
        ]
        ps = [p for lin in lins for p in _tensors(lin)]
        # where each tensor lives and how often it was written (load_state_dict writes);
        # an inference tensor keeps no count (a model loaded under torch.inference_mode)
        key = tuple(
            (p.data_ptr(), -1 if p.is_inference() else p._version, p.dtype, p.device) for p in ps
        )
        if getattr(self, "_fused_key", None) != key:
            self._fused_qkv = [_concat(lins[i : i + 3]) for i in range(0, len(lins), 3)]
            self._fused_key = key
        return self._fused_qkv

    def logits(self, states: Tensor) -> Tensor:
        """``states [..., d]`` → ``[..., vocab]`` (the tied token embedding)."""
        return states @ self.embed.weight.T

    def forward(self, ids: Tensor, audio: Tensor) -> Tensor:
        return self.logits(self.states(ids, audio)[0])


def _norm(ln: nn.LayerNorm, x: Tensor) -> Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _linear(lin: nn.Module, x: Tensor) -> Tensor:
    if type(lin) is nn.Linear:  # F.linear directly: no module call (~10 us each, 28 a token)
        return F.linear(x, lin.weight, lin.bias)
    return cast("Tensor", lin.forward(x))  # an Int8Linear (hooks: none, by can_step)


def _tensors(lin: nn.Module) -> list[Tensor]:
    """The tensors that define a linear layer (float weight and bias, or int8 ones)."""
    if isinstance(lin, Int8Linear):
        return [t for t in (lin.qweight, lin.scale, lin.bias) if t is not None]
    assert isinstance(lin, nn.Linear) and lin.bias is not None, lin
    return [lin.weight, lin.bias]


def _concat(lins: list[nn.Module]) -> Callable[[Tensor], Tensor]:
    """One linear layer computing ``lins`` on the same input, outputs concatenated."""
    if all(isinstance(lin, Int8Linear) for lin in lins):
        int8 = cast("list[Int8Linear]", lins)
        # the same input gives the same activation scale, so this equals the three calls
        return Int8Linear(
            torch.cat([lin.qweight for lin in int8]),
            torch.cat([lin.scale for lin in int8]),
            torch.cat([cast("Tensor", lin.bias) for lin in int8]),
        )
    if not all(type(lin) is nn.Linear for lin in lins):
        raise TypeError(
            f"the decoder's q/k/v projections must all be nn.Linear or all Int8Linear, got "
            f"{[type(lin).__name__ for lin in lins]}"
        )
    w = torch.cat([cast("Tensor", lin.weight) for lin in lins])  # [3d, d]
    b = torch.cat([cast("Tensor", lin.bias) for lin in lins])  # [3d]
    return partial(F.linear, weight=w, bias=b)


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(
        module._global_forward_hooks
        or module._global_forward_pre_hooks
        or module._global_forward_hooks_with_kwargs
    )

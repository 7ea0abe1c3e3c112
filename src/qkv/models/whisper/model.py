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

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ...cache import KVCache
from ...cross_cache import CrossKVCache
from ...masks import causal
from ...modules import MultiHeadAttention

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

    def logits(self, states: Tensor) -> Tensor:
        """``states [..., d]`` → ``[..., vocab]`` (the tied token embedding)."""
        return states @ self.embed.weight.T

    def forward(self, ids: Tensor, audio: Tensor) -> Tensor:
        return self.logits(self.states(ids, audio)[0])

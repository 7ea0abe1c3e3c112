"""A Llama-family decoder whose every attention call is a :class:`qkv.MultiHeadAttention`.

The layer is Llama's pre-norm block (Touvron et al. 2023): RMSNorm, causal grouped-query
self-attention with RoPE, RMSNorm, SwiGLU (Shazeer 2020)::

    x = x + attention(attn_norm(x), mask=qkv.causal)                    # [B, L, d]
    h = ffn_norm(x)
    x = x + down(silu(gate(h)) * up(h))                                 # [B, L, d]

and the stack ends with a final RMSNorm and the output head (often the embedding table,
tied). The modules hold parameters only; :func:`qkv.models.load` fills them from a GGUF file
or a Hugging Face folder.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..masks import and_masks, causal
from ..modules import MultiHeadAttention
from ..rope import RotaryEmbedding
from . import quantized
from ._llama_config import LlamaConfig

Tensor = torch.Tensor

__all__ = ["DecoderOutput", "LlamaDecoder", "LlamaLayer"]


class DecoderOutput(NamedTuple):
    """What :meth:`LlamaDecoder.forward` returns: ``logits [B, L, vocab]`` (``[B, 1, vocab]``
    with ``last_only=True``) and ``attentions`` (``n_layers`` of ``[B, H, L, Lk]``, or
    ``None``)."""

    logits: Tensor  # [B, L, vocab] (or [B, 1, vocab] with last_only=True), float
    attentions: tuple[Tensor, ...] | None  # n_layers of [B, H, L, Lk] attention weights


class RMSNorm(nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` whose float32 CPU inference rows go through one compiled
    call (``rms_norm`` in ``kernels/quant.cpp``) where the GGUF kernels' library is built:
    decoding calls it 61 times a token, ~10 us each as torch's ~8 operators, ~2 us as one.
    Anything else (gradients, other dtypes or devices, torch.compile, no library) is
    ``F.rms_norm``. The one-token step calls :func:`rms_norm` too, so its logits stay the
    forward's bit for bit."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(self, x)


def rms_norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """``norm(x)`` for ``x [..., d]`` (``d``: ``norm``'s width) -> ``[..., d]``: the compiled
    row norm where it applies (see :class:`RMSNorm`), else ``F.rms_norm`` with ``norm``'s
    shape, weight and epsilon."""
    w = norm.weight
    if (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and w is not None
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and len(norm.normalized_shape) == 1
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and not torch.compiler.is_compiling()
    ):
        ops = quantized.LIBRARY.ops_if_built()
        if ops is not None:
            eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
            return cast("Tensor", ops.rms_norm(x, w, eps))
    return F.rms_norm(x, list(norm.normalized_shape), w, norm.eps)


class LlamaLayer(nn.Module):
    """One pre-norm decoder block; ``attention`` is a :class:`qkv.MultiHeadAttention`.
    ``x [B, L, d]`` → ``(x [B, L, d], weights [B, H, L, Lk] or None)``."""

    def __init__(self, config: LlamaConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        d = config.d_model
        self.attn_norm = RMSNorm(d, eps=config.norm_eps)
        self.attention = MultiHeadAttention(
            d, config.n_heads, n_kv_heads=config.n_kv_heads, bias=False, rope=rope
        )
        self.ffn_norm = RMSNorm(d, eps=config.norm_eps)
        self.gate = nn.Linear(d, config.d_ff, bias=False)
        self.up = nn.Linear(d, config.d_ff, bias=False)
        self.down = nn.Linear(config.d_ff, d, bias=False)

    def forward(
        self,
        x: Tensor,
        *,
        mask: object,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``x [B, L, d]`` → ``(x [B, L, d], weights [B, H, L, Lk] or None)``."""
        weights: Tensor | None = None
        h = self.attn_norm(x)
        if need_weights:
            a, weights = self.attention(h, mask=mask, cache=cache, need_weights=True)
        else:
            a = self.attention(h, mask=mask, cache=cache)
        x = x + a  # [B, L, d]
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), weights


def _starts_mask(starts: Tensor) -> object:
    """Causal attention that also skips each row's left padding: key ``j`` of row ``b`` is
    visible to query ``i`` when ``starts[b] <= j <= i`` (positions are absolute, so the same
    mask_mod serves the prefill and every cached step)."""

    def after_padding(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx >= starts[b]

    return and_masks(causal, after_padding)


class LlamaDecoder(nn.Module):
    """Token embedding, the stack of :class:`LlamaLayer`, the final norm and the output head:
    token ids ``[B, L]`` → logits ``[B, L, vocab]``. ``layers[i].attention`` is layer ``i``'s
    :class:`qkv.MultiHeadAttention`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        # One RoPE for all layers: its cos/sin tables are computed once, not once per layer.
        rope = RotaryEmbedding(config.head_dim, base=config.rope_base)
        self.layers = nn.ModuleList(LlamaLayer(config, rope) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_caches(self, max_len: int) -> list[KVCache]:
        """One :class:`qkv.KVCache` of ``max_len`` tokens per layer."""
        return [KVCache(max_len) for _ in self.layers]

    def forward(
        self,
        input_ids: Tensor,
        *,
        caches: list[KVCache] | None = None,
        starts: Tensor | None = None,
        need_weights: bool = False,
        last_only: bool = False,
    ) -> DecoderOutput:
        """Run the decoder.

        Args:
            input_ids: ``[B, L]`` integer token ids. With ``caches`` they continue the cached
                sequence (``caches[0].length`` tokens so far); the whole sequence must fit in
                ``config.max_positions``.
            caches: one :class:`qkv.KVCache` per layer (:meth:`new_caches`), or None.
            starts: ``[B]`` the first real position of each row of a left-padded batch; keys
                before it are masked (default: no padding).
            need_weights: also return each layer's attention weights ``[B, H, L, Lk]``.
            last_only: compute the logits of the last position only (``[B, 1, vocab]``):
                what decoding needs, and a 49152-wide head over 1024 tokens is a fifth of a
                SmolLM2 prefill's FLOPs.

        Returns:
            :class:`DecoderOutput` ``(logits, attentions)``.
        """
        _check_ids(input_ids, self.config, caches)
        if caches is not None and len(caches) != len(self.layers):
            raise ValueError(
                f"caches has {len(caches)} entries but the model has {len(self.layers)} layers; "
                f"make them with model.new_caches(max_len)"
            )
        mask = causal if starts is None else _starts_mask(starts.to(input_ids.device))
        x = self.embed(input_ids)  # [B, L, d]
        maps: list[Tensor] | None = [] if need_weights else None
        for i, layer in enumerate(self.layers):
            cache = caches[i] if caches is not None else None
            x, w = layer(x, mask=mask, cache=cache, need_weights=need_weights)
            if maps is not None and w is not None:
                maps.append(w)
        if last_only:
            x = x[:, -1:]  # [B, 1, d]
        logits = self.lm_head(self.norm(x))  # [B, L, vocab]
        return DecoderOutput(logits, tuple(maps) if maps is not None else None)


def _check_ids(input_ids: Tensor, config: LlamaConfig, caches: list[KVCache] | None) -> None:
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be [B, L] with L >= 1, got shape {list(input_ids.shape)}; "
            f"use ids[None] for a single sequence"
        )
    before = caches[0].length if caches else 0
    total = before + input_ids.shape[1]
    if total > config.max_positions:
        raise ValueError(
            f"{total} tokens ({before} cached + {input_ids.shape[1]} new) exceed this model's "
            f"context of {config.max_positions} tokens; shorten the prompt or max_new_tokens"
        )
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= config.vocab_size:
        raise ValueError(
            f"input_ids must lie in [0, {config.vocab_size}) (the vocabulary), got values in "
            f"[{int(input_ids.min())}, {int(input_ids.max())}]"
        )

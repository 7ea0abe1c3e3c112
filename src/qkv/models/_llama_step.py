"""One decoding step of :class:`~qkv.models.LlamaDecoder` with its Python cut down.

Decoding SmolLM2-135M at one thread, a token is ~200 small operator calls around 211 linear
products: ~5 ms of a ~17 ms token went to module calls, their checks, RMSNorm's composite and
RoPE (benchmarks/RESULTS.md). :func:`step` computes what ``decoder(ids [B, 1], caches=caches,
last_only=True)`` computes for one new token per row, on the same qkv caches (filled by a
forward over the prompt first) and :func:`qkv.attention` on them, with:

- the layers' norms, RoPE and linears called directly (``F.rms_norm``, the decoder's own
  :class:`qkv.RotaryEmbedding`, ``forward`` of each linear): no module calls;
- each layer's ``q/k/v`` projections as one product, and ``gate/up`` as one, where they are
  :class:`~qkv.models.quantized.QuantizedLinear` of one format: their blocks are stacked
  once (the modules then hold row views of the stack, so no memory is doubled). Each output
  of the kernel is its own dot product over its weight row, so a stacked product equals the
  separate ones bit for bit;
- the new key and value written into the cache buffers in place, and one query (the last
  position, which ``qkv.causal`` lets see every cached key) attending to them.

It runs only where it stands in exactly (:func:`can_step`): inference (no autograd), not
training, no module or global hooks (``qkv.inspect.record`` hooks the attention modules; a
recorded run takes the modules, so that every call is seen), plain :class:`qkv.KVCache`
caches all holding the same tokens with room for one more, and no left padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..functional import attention
from .quantized import FORMATS, MAX_ROWS, QuantizedLinear, kernel

if TYPE_CHECKING:
    from .llama import LlamaDecoder, LlamaLayer

Tensor = torch.Tensor

__all__ = ["can_step", "step"]


def can_step(decoder: LlamaDecoder, caches: list[KVCache] | None) -> bool:
    """Whether :func:`step` may stand in for the decoder's forward on one token per row."""
    if caches is None or torch.is_grad_enabled() or decoder.training or _global_hooks():
        return False
    if len(caches) != len(decoder.layers) or any(type(c) is not KVCache for c in caches):
        return False
    n = caches[0].length
    for c in caches:  # (the kernel takes few rows: a larger batch multiplies float32 weights)
        if c._k is None or c._k.shape[0] > MAX_ROWS:
            return False
        if c.length != n or n == 0 or n + 1 > c.max_len or c._v is None:
            return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in decoder.modules()):
        return False
    a = cast("LlamaLayer", decoder.layers[0]).attention
    return a.q_norm is None and a.rope is not None and a.rope.dim == a.head_dim


def step(decoder: LlamaDecoder, ids: Tensor, caches: list[KVCache]) -> Tensor:
    """Logits ``[B, 1, vocab]`` of one new token per row (``ids [B, 1]``) after the cached
    ones, as ``decoder(ids, caches=caches, last_only=True).logits``; only where
    :func:`can_step`. The caches advance by one."""
    n = caches[0].length
    B = ids.shape[0]
    x = decoder.embed.weight[ids[:, 0]]  # [B, d]
    fused = _fused(decoder)
    for layer, cache, (qkv_proj, gate_up) in zip(
        cast("list[LlamaLayer]", decoder.layers), caches, fused, strict=True
    ):
        a = layer.attention
        H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
        h = _norm(layer.attn_norm, x)
        qkv_ = qkv_proj(h)  # [B, (H + 2 Hkv) D]
        qk = qkv_[:, : (H + Hkv) * D].view(B, H + Hkv, 1, D)
        qk = cast("nn.Module", a.rope).forward(qk, offset=n)  # q and k rotated at once
        kb, vb = cache._k, cache._v
        assert kb is not None and vb is not None
        kb[:, :, n].copy_(qk[:, H:, 0])
        vb[:, :, n].copy_(qkv_[:, (H + Hkv) * D :].view(B, Hkv, D))
        o = cast("Tensor", attention(qk[:, :H], kb[:, :, : n + 1], vb[:, :, : n + 1]))
        x = x + _linear(a.out_proj, o.view(B, H * D))
        gu = gate_up(_norm(layer.ffn_norm, x))  # [B, 2 d_ff]
        g, u = gu.chunk(2, dim=-1)
        x = x + _linear(layer.down, F.silu(g) * u)
    for cache in caches:
        cache._advance(1)
    return _linear(decoder.lm_head, _norm(decoder.norm, x)).view(B, 1, -1)


def _norm(norm: nn.Module, x: Tensor) -> Tensor:
    m = cast("nn.RMSNorm", norm)
    return F.rms_norm(x, cast("list[int]", m.normalized_shape), m.weight, m.eps)


def _linear(lin: nn.Module, x: Tensor) -> Tensor:
    if type(lin) is nn.Linear:
        return F.linear(x, lin.weight, lin.bias)
    return cast("Tensor", lin.forward(x))


def _fused(decoder: LlamaDecoder) -> list[tuple[Any, Any]]:
    """Per layer, the ``q/k/v`` product and the ``gate/up`` product (``x -> [q | k | v]``,
    ``x -> [gate | up]``): one :class:`QuantizedLinear` over the stacked blocks where the
    parts allow, else the parts called one after the other. Made again when a part's blocks,
    format or arithmetic change."""
    parts = [
        (
            (layer.attention.q_proj, layer.attention.k_proj, layer.attention.v_proj),
            (layer.gate, layer.up),
        )
        for layer in cast("list[LlamaLayer]", decoder.layers)
    ]
    key = tuple(_key(m) for qkv_, gu in parts for m in (*qkv_, *gu))
    cached = decoder.__dict__.get("_step_fused")
    if cached is not None and cached[0] == key:
        return cast("list[tuple[Any, Any]]", cached[1])
    fused = [(_stack(qkv_), _stack(gu)) for qkv_, gu in parts]
    key = tuple(_key(m) for qkv_, gu in parts for m in (*qkv_, *gu))  # the views now held
    decoder.__dict__["_step_fused"] = (key, fused)
    return fused


def _key(m: nn.Module) -> tuple[object, ...]:
    if isinstance(m, QuantizedLinear):
        b = m._buffers["blocks"]
        assert b is not None
        return (id(m), b.data_ptr(), tuple(b.shape), b.device, m.qtype, m.int8_activations)
    return (id(m),)


def _stack(mods: tuple[nn.Module, ...]) -> Any:
    """One product for ``mods`` side by side, or their products concatenated."""
    qs = [m for m in mods if isinstance(m, QuantizedLinear)]
    if (
        len(qs) == len(mods)
        and len({(m.qtype, m.in_features, m.int8_activations) for m in qs}) == 1
    ):
        blocks = [cast("Tensor", m._buffers["blocks"]) for m in qs]
        ops = kernel()
        if ops is not None and len({b.device for b in blocks}) == 1 and not blocks[0].is_cuda:
            stacked = torch.cat(blocks)  # [sum of out_features, bytes per row]
            row = 0
            for m in qs:  # each part now reads its rows of the stack (no second copy)
                m._buffers["blocks"] = stacked[row : row + m.out_features]
                row += m.out_features
            op = ops.linear_q8 if qs[0].int8_activations else ops.linear
            code, k = FORMATS[qs[0].qtype][0], qs[0].in_features
            return lambda x: op(x, stacked, code, k)
    return lambda x: torch.cat([_linear(m, x) for m in mods], dim=-1)


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(
        module._global_forward_hooks
        or module._global_forward_pre_hooks
        or module._global_forward_hooks_with_kwargs
    )

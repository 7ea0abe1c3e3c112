"""One decoding step of :class:`~qkv.models.LlamaDecoder` with its Python cut down.

Decoding SmolLM2-135M at one thread, a token is ~400 module calls and ~200 small operators
around 211 linear products: ~5 ms of a ~17 ms token went to module calls, their checks,
RoPE and the attention module's bookkeeping (benchmarks/RESULTS.md). A :class:`Stepper`
computes what ``decoder(ids [B, 1], caches=caches, last_only=True)`` computes for one new
token per row, on the same qkv caches (filled by a forward over the prompt first) and
:func:`qkv.attention` on them, with:

- the layers' norms, RoPE and linears called directly (:func:`~qkv.models.llama.rms_norm`,
  the decoder's own :class:`qkv.RotaryEmbedding` on q and k at once, each linear as the
  kernel call or ``F.linear`` it would make): no module calls;
- each layer's ``q/k/v`` projections as one product, and ``gate/up`` as one, where they are
  :class:`~qkv.models.quantized.QuantizedLinear` of one format and arithmetic: their blocks
  are stacked once (the modules then hold row views of the stack, so no memory is doubled).
  Each output of the kernel is its own dot product over its weight row (and an input row is
  quantised the same way whichever rows follow), so a stacked product equals the separate
  ones bit for bit;
- the new key and value written into the cache buffers in place, and one query (the last
  position, which ``qkv.causal`` lets see every cached key) attending to them.

The logits equal the forward's bit for bit (``tests/test_decoder_step.py``). The decoding
loop (``_generate.decode_tokens``) makes one stepper per run and takes it where
:meth:`Stepper.can_step`: inference (no autograd), not training, no module or global hooks
(``qkv.inspect.record`` hooks the attention modules; a recorded run takes the modules, so
that every call is seen), plain :class:`qkv.KVCache` caches all holding the same tokens with
room for one more, at most ``quantized.MAX_ROWS`` rows, and no left padding.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..functional import attention
from .llama import rms_norm
from .quantized import FORMATS, MAX_ROWS, QuantizedLinear, kernel

if TYPE_CHECKING:
    from .llama import LlamaDecoder, LlamaLayer

Tensor = torch.Tensor

__all__ = ["Stepper", "can_step", "step"]


class Stepper:
    """The step for one decoding run of ``decoder``: its modules listed, its products stacked
    and each layer's parts looked up once, when decoding starts (the module tree and the
    weights' arithmetic do not change while tokens are being decoded; hooks may come and go,
    and :meth:`can_step` looks for them every time)."""

    def __init__(self, decoder: LlamaDecoder) -> None:
        self.decoder = decoder
        self.modules = list(decoder.modules())
        a = cast("LlamaLayer", decoder.layers[0]).attention
        rope = a.rope
        self.fits = a.q_norm is None and rope is not None and rope.dim == a.head_dim
        self.rope = rope
        self.layers = [
            (
                *(layer.attn_norm, a.n_heads, a.n_kv_heads, a.head_dim, qkv_),
                *(_product(a.out_proj), layer.ffn_norm, gate_up, _product(layer.down)),
            )
            for layer, (qkv_, gate_up) in zip(
                cast("list[LlamaLayer]", decoder.layers), _fused(decoder), strict=True
            )
            for a in (layer.attention,)
        ]
        self.head = _product(decoder.lm_head)

    def can_step(self, caches: list[KVCache] | None) -> bool:
        """Whether :meth:`__call__` may stand in for the decoder's forward on one token per
        row over ``caches``."""
        dec = self.decoder
        if caches is None or torch.is_grad_enabled() or dec.training or _global_hooks():
            return False
        if not self.fits or len(caches) != len(self.layers):
            return False
        n = caches[0].length
        for c in caches:  # (the kernel takes few rows: a larger batch multiplies float32 weights)
            if type(c) is not KVCache or c._k is None or c._v is None or c._k.shape[0] > MAX_ROWS:
                return False
            if c.length != n or n == 0 or n + 1 > c.max_len:
                return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    def __call__(self, ids: Tensor, caches: list[KVCache]) -> Tensor:
        """Logits ``[B, 1, vocab]`` of one new token per row (``ids [B, 1]``) after the
        cached ones, as ``decoder(ids, caches=caches, last_only=True).logits``; only where
        :meth:`can_step`. The caches advance by one."""
        n = caches[0].length
        B = ids.shape[0]
        x = self.decoder.embed.weight[ids[:, 0]]  # [B, d]
        rope = cast("nn.Module", self.rope)
        for (attn_norm, H, Hkv, D, qkv_proj, out, ffn_norm, gate_up, down), cache in zip(
            self.layers, caches, strict=True
        ):
            qkv_ = qkv_proj(_norm(attn_norm, x))  # [B, (H + 2 Hkv) D]
            qk = qkv_[:, : (H + Hkv) * D].view(B, H + Hkv, 1, D)
            qk = rope.forward(qk, offset=n)  # q and k rotated at once
            kb, vb = cache._k, cache._v
            assert kb is not None and vb is not None
            kb[:, :, n].copy_(qk[:, H:, 0])
            vb[:, :, n].copy_(qkv_[:, (H + Hkv) * D :].view(B, Hkv, D))
            # one query at the last position: qkv.causal lets it see every cached key
            o = cast("Tensor", attention(qk[:, :H], kb[:, :, : n + 1], vb[:, :, : n + 1]))
            x = x + out(o.view(B, H * D))
            g, u = gate_up(_norm(ffn_norm, x)).chunk(2, dim=-1)  # [B, d_ff] each
            x = x + down(F.silu(g) * u)
        for cache in caches:
            cache._advance(1)
        return self.head(_norm(self.decoder.norm, x)).view(B, 1, -1)


def can_step(decoder: LlamaDecoder, caches: list[KVCache] | None) -> bool:
    """Whether :func:`step` may stand in for the decoder's forward on one token per row."""
    return Stepper(decoder).can_step(caches)


def step(decoder: LlamaDecoder, ids: Tensor, caches: list[KVCache]) -> Tensor:
    """One :class:`Stepper` step (a decoding loop keeps its stepper between tokens)."""
    return Stepper(decoder)(ids, caches)


def _norm(norm: nn.Module, x: Tensor) -> Tensor:
    return rms_norm(cast("nn.RMSNorm", norm), x)  # (what the module's forward calls)


def _product(lin: nn.Module) -> Any:
    """``x [B, in] -> [B, out]`` for one linear module, called without its module call."""
    return _stack((lin,))


def _fused(decoder: LlamaDecoder) -> list[tuple[Any, Any]]:
    """Per layer, the ``q/k/v`` product and the ``gate/up`` product (``x -> [q | k | v]``,
    ``x -> [gate | up]``): one kernel call over the stacked blocks where the parts allow,
    else the parts called one after the other. Kept on the decoder; made again when a part's
    blocks, format or arithmetic change."""
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
    """``x [B, in] -> [B, sum of out]``: the kernel on ``mods``' blocks stacked (all
    :class:`QuantizedLinear` of one format and arithmetic), else the modules' own products
    concatenated. Called without module calls: only where :meth:`Stepper.can_step`."""
    qs = [m for m in mods if isinstance(m, QuantizedLinear)]
    if (
        len(qs) == len(mods)
        and len({(m.qtype, m.in_features, m.int8_activations) for m in qs}) == 1
    ):
        blocks = [cast("Tensor", m._buffers["blocks"]) for m in qs]
        ops = kernel()
        if ops is not None and len({b.device for b in blocks}) == 1 and not blocks[0].is_cuda:
            stacked = blocks[0]
            if len(blocks) > 1:
                stacked = torch.cat(blocks)  # [sum of out_features, bytes per row]
                row = 0
                for m in qs:  # each part now reads its rows of the stack (no second copy)
                    m._buffers["blocks"] = stacked[row : row + m.out_features]
                    row += m.out_features
            op = ops.linear_q8 if qs[0].int8_activations else ops.linear
            code, k = FORMATS[qs[0].qtype][0], qs[0].in_features
            return lambda x: op(x, stacked, code, k)
    if len(mods) == 1:
        one = mods[0]
        if type(one) is nn.Linear:
            return partial(F.linear, weight=one.weight, bias=one.bias)
        return one.forward
    return lambda x: torch.cat([_stack((part,))(x) for part in mods], dim=-1)


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(
        module._global_forward_hooks
        or module._global_forward_pre_hooks
        or module._global_forward_hooks_with_kwargs
    )

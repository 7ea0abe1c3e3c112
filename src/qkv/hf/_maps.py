"""Attention maps of a transformers model run on qkv, for :mod:`qkv.viz` (``qkv explain``)."""

from __future__ import annotations

from typing import Any

import torch

from ..inspect import Capture, record
from ..viz import AttentionMaps


def _self_attention(c: Capture, L: int) -> bool:
    return c.q is not None and c.k is not None and c.q.shape[2] == c.k.shape[2] == L


def attention_maps(model: Any, tokenizer: Any, text: str) -> AttentionMaps:
    """Run ``text`` through ``model`` (loaded or switched to ``attn_implementation="qkv"``)
    under :func:`qkv.inspect.record` and rebuild each self-attention layer's weights from the
    recorded q, k and lse.

    Args:
        model: a transformers model whose attention runs on qkv.
        tokenizer: its tokenizer (called as ``tokenizer(text, return_tensors="pt")``).
        text: one text.

    Returns:
        :class:`qkv.viz.AttentionMaps` with ``weights [layers, heads, L, L]``, ready for
        ``qkv.viz.terminal.render`` / ``png.render`` / ``html.render``.
    """
    enc = tokenizer(text, return_tensors="pt")
    ids = enc["input_ids"]  # [1, L]
    L = ids.shape[1]
    with torch.inference_mode(), record(model) as rec:
        model(**enc)
    layers = [name for name in rec.layers if _self_attention(rec[name], L)]
    if not layers:
        raise ValueError(
            f"no attention call of {type(model).__name__} went through qkv; load it with "
            f"attn_implementation='qkv' after qkv.hf.register()"
        )
    weights = torch.stack([rec[name].weights()[0] for name in layers])  # [layers, H, L, L]
    tokens = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return AttentionMaps(list(tokens), weights.float().cpu(), text, str(name))

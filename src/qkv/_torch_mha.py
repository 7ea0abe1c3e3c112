"""Weight conversion between ``torch.nn.MultiheadAttention`` and ``qkv.MultiHeadAttention``.

torch keeps the three in-projections either packed (``in_proj_weight [3E, E]``, rows q|k|v) or
separate (``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` when kdim/vdim differ from
``embed_dim``), with one packed ``in_proj_bias [3E]``; ``out_proj`` is a ``Linear``.

``qkv.modules`` imports this file for ``MultiHeadAttention.from_torch`` / ``to_torch``, so this
file does not import it back: it reads and writes a qkv module only through :class:`Layer`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

Tensor = torch.Tensor


class Layer(Protocol):
    """What the conversions use of a ``qkv.MultiHeadAttention``."""

    @property
    def d_model(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def kdim(self) -> int: ...
    @property
    def vdim(self) -> int: ...
    @property
    def dropout(self) -> float: ...
    @property
    def training(self) -> bool: ...
    @property
    def rope(self) -> object: ...
    @property
    def q_norm(self) -> object: ...
    @property
    def q_proj(self) -> nn.Linear: ...
    @property
    def k_proj(self) -> nn.Linear: ...
    @property
    def v_proj(self) -> nn.Linear: ...
    @property
    def out_proj(self) -> nn.Linear: ...


def constructor_args(m: nn.MultiheadAttention) -> dict[str, Any]:
    """The ``qkv.MultiHeadAttention(...)`` arguments that reproduce ``m``, after refusing the
    options qkv does not model."""
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"from_torch needs a torch.nn.MultiheadAttention, got {type(m).__name__}")
    if m.bias_k is not None or m.bias_v is not None:
        raise ValueError(
            "this torch.nn.MultiheadAttention has add_bias_kv=True (learned key/value appended "
            "to every sequence), which qkv.MultiHeadAttention does not model"
        )
    if m.add_zero_attn:
        raise ValueError(
            "this torch.nn.MultiheadAttention has add_zero_attn=True (a zero key/value appended "
            "to every sequence), which qkv.MultiHeadAttention does not model"
        )
    has_in_bias = m.in_proj_bias is not None
    has_out_bias = m.out_proj.bias is not None
    if has_in_bias != has_out_bias:
        raise ValueError(
            f"torch module has in-projection bias {has_in_bias} but out-projection bias "
            f"{has_out_bias}; qkv's bias= flag covers all four projections together"
        )
    w = m.out_proj.weight
    return {
        "d_model": m.embed_dim,
        "n_heads": m.num_heads,
        "kdim": m.kdim,
        "vdim": m.vdim,
        "bias": has_in_bias,
        "dropout": float(m.dropout),
        "device": w.device,
        "dtype": w.dtype,
    }


def copy_from_torch(m: nn.MultiheadAttention, new: Layer) -> None:
    """Copy ``m``'s weights into ``new``, made with :func:`constructor_args`."""
    has_in_bias = m.in_proj_bias is not None
    with torch.no_grad():
        if m._qkv_same_embed_dim:
            assert m.in_proj_weight is not None
            wq, wk, wv = m.in_proj_weight.chunk(3, dim=0)  # [E, E] each
        else:
            wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        new.q_proj.weight.copy_(wq)
        new.k_proj.weight.copy_(wk)
        new.v_proj.weight.copy_(wv)
        new.out_proj.weight.copy_(m.out_proj.weight)
        if has_in_bias:
            assert m.in_proj_bias is not None and m.out_proj.bias is not None
            bq, bk, bv = m.in_proj_bias.chunk(3)  # [E] each
            new.q_proj.bias.copy_(bq)
            new.k_proj.bias.copy_(bk)
            new.v_proj.bias.copy_(bv)
            new.out_proj.bias.copy_(m.out_proj.bias)


def to_torch(mha: Layer, *, batch_first: bool) -> nn.MultiheadAttention:
    if mha.n_kv_heads != mha.n_heads:
        raise ValueError(
            f"torch.nn.MultiheadAttention has no grouped-query attention, but this module has "
            f"n_kv_heads={mha.n_kv_heads} < n_heads={mha.n_heads}"
        )
    if mha.rope is not None:
        raise ValueError("torch.nn.MultiheadAttention has no rotary embeddings (rope is set)")
    if mha.q_norm is not None:
        raise ValueError("torch.nn.MultiheadAttention has no qk_norm (qk_norm=True here)")
    w = mha.q_proj.weight
    bias = mha.q_proj.bias is not None
    m = nn.MultiheadAttention(
        mha.d_model,
        mha.n_heads,
        dropout=mha.dropout,
        bias=bias,
        kdim=mha.kdim,
        vdim=mha.vdim,
        batch_first=batch_first,
        device=w.device,
        dtype=w.dtype,
    )
    with torch.no_grad():
        if m._qkv_same_embed_dim:
            assert m.in_proj_weight is not None
            wq, wk, wv = mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight
            m.in_proj_weight.copy_(torch.cat((wq, wk, wv)))  # [3E, E]
        else:
            m.q_proj_weight.copy_(mha.q_proj.weight)
            m.k_proj_weight.copy_(mha.k_proj.weight)
            m.v_proj_weight.copy_(mha.v_proj.weight)
        m.out_proj.weight.copy_(mha.out_proj.weight)
        if bias:
            assert m.in_proj_bias is not None and m.out_proj.bias is not None
            bq, bk, bv = mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias
            m.in_proj_bias.copy_(torch.cat((bq, bk, bv)))  # [3E]
            m.out_proj.bias.copy_(mha.out_proj.bias)
    m.train(mha.training)
    return m

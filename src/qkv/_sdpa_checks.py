"""The argument checks of :func:`qkv.scaled_dot_product_attention`: torch's types, shapes
and head counts, refused with the values and the fix, as errors that are both qkv's kind
(``ValueError``, ``TypeError``) and torch's (``RuntimeError``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ._core.checks import InputTypeError, InputValueError

Tensor = torch.Tensor

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SDPAValueError(InputValueError):
    """Bad shapes or values. A ValueError as qkv raises, and a RuntimeError as torch's
    function raises for the same input, so callers written for either catch it (qkv's own
    input errors are both as well: this one names the drop-in as the checker)."""


class SDPATypeError(InputTypeError):
    """Bad types (dtypes, non-tensors); also a RuntimeError, as torch raises."""


def check_types(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    dropout_p: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise SDPATypeError(
                f"scaled_dot_product_attention: {name} must be a Tensor, got {type(t).__name__}"
            )
        if t.is_nested:
            raise SDPATypeError(
                f"scaled_dot_product_attention: {name} is a nested tensor, which qkv does not "
                f"take; pad it to a dense tensor with a key-padding mask, or call torch's function"
            )
        if t.dtype not in _FLOATS:
            raise SDPATypeError(
                f"scaled_dot_product_attention: {name} has dtype {t.dtype}; query, key and value "
                f"must be float16, bfloat16, float32 or float64"
            )
        if t.dim() < 2:
            raise SDPAValueError(
                f"scaled_dot_product_attention: {name} has shape {tuple(t.shape)}; it needs at "
                f"least 2 dims [L, D] (usually [B, H, L, D])"
            )
    if not query.dtype == key.dtype == value.dtype:
        raise SDPATypeError(
            f"scaled_dot_product_attention: query, key and value must have one dtype, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}; convert them with .to(dtype)"
        )
    if not query.device == key.device == value.device:
        raise SDPAValueError(
            f"scaled_dot_product_attention: query, key and value must be on one device, got "
            f"{query.device}, {key.device} and {value.device}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise SDPAValueError(
            f"scaled_dot_product_attention: query's last dim is {query.shape[-1]} but key's is "
            f"{key.shape[-1]}; query @ keyᵀ needs the same head dim D"
        )
    if key.shape[-2] != value.shape[-2]:
        raise SDPAValueError(
            f"scaled_dot_product_attention: key has {key.shape[-2]} positions (shape "
            f"{tuple(key.shape)}) but value has {value.shape[-2]} (shape {tuple(value.shape)}); "
            f"they need the same Lk"
        )
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise SDPATypeError(
                f"scaled_dot_product_attention: attn_mask must be a Tensor or None, got "
                f"{type(attn_mask).__name__}"
            )
        ok = (torch.bool, torch.float32, query.dtype)
        if attn_mask.dtype not in ok:
            raise SDPATypeError(
                f"scaled_dot_product_attention: attn_mask has dtype {attn_mask.dtype}; it must "
                f"be bool (True = attend), float32 or query's dtype {query.dtype} (added to the "
                f"scores), as in torch"
            )
        if attn_mask.device != query.device:
            raise SDPAValueError(
                f"scaled_dot_product_attention: attn_mask is on {attn_mask.device} but query "
                f"on {query.device}; move the mask with .to(query.device)"
            )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise SDPATypeError(
            f"scaled_dot_product_attention: dropout_p must be a float, got "
            f"{type(dropout_p).__name__}"
        )
    if not 0.0 <= dropout_p <= 1.0:
        raise SDPAValueError(
            f"scaled_dot_product_attention: dropout probability has to be between 0 and 1, but "
            f"got {dropout_p}"
        )
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise SDPATypeError(
                f"scaled_dot_product_attention: {name} must be a bool, got {type(flag).__name__}"
            )
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise SDPATypeError(
                f"scaled_dot_product_attention: scale must be a float or None, got "
                f"{type(scale).__name__}"
            )
        if not math.isfinite(scale):
            raise SDPAValueError(
                f"scaled_dot_product_attention: scale must be finite, got {scale}; None gives "
                f"1 / sqrt(D)"
            )


def batch_shape(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, ...]:
    """The broadcast leading (batch) dims of query, key and value, as torch's matmul forms them."""
    try:
        return tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    except RuntimeError:
        raise SDPAValueError(
            f"scaled_dot_product_attention: the batch dims of query {tuple(q.shape[:-3])}, key "
            f"{tuple(k.shape[:-3])} and value {tuple(v.shape[:-3])} do not broadcast; make them "
            f"equal or 1"
        ) from None


def heads(
    hq: int, hk: int, hv: int, gqa: bool, query: Tensor, key: Tensor, value: Tensor
) -> tuple[int, int]:
    """``(query heads, key/value heads)`` as qkv gets them; raises where torch would.

    Equal heads, one kv head (multi-query) and, with ``enable_gqa``, kv heads dividing query
    heads go to qkv as they are. Otherwise heads broadcast as torch's matmul broadcasts them
    (a 1 against any count), by expanding views.
    """
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if hk == hv and (hq == hk or hk == 1 or (gqa and hq % hk == 0)):
        return hq, hk
    if not (gqa and hk == hv):
        try:
            h = torch.broadcast_shapes((hq,), (hk,), (hv,))[0]
            return h, h
        except RuntimeError:
            pass
    if gqa:
        raise SDPAValueError(
            f"scaled_dot_product_attention: Number of heads in key and value must divide the "
            f"number of heads in query: query has {hq}, key {hk} and value {hv} ({shapes})"
        )
    raise SDPAValueError(
        f"scaled_dot_product_attention: query has {hq} heads, key {hk} and value {hv} "
        f"({shapes}); pass enable_gqa=True for grouped-query attention (kv heads dividing query "
        f"heads), or give head counts that are equal or 1"
    )


def grouped(hq: int, hk: int, hv: int, gqa: bool) -> bool:
    return hk == hv and (hq == hk or (gqa and hq % hk == 0))

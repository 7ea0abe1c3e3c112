"""Value checks shared by every entry point, and the index tensors mods are called with.

Every check runs before any attention arithmetic, and every error names the values it got and
what would work. Shapes and values raise :class:`InputValueError` (a ``ValueError``); types
raise :class:`InputTypeError` (a ``TypeError``); both are ``RuntimeError`` too, the class
torch's ``scaled_dot_product_attention`` raises for the same input, so code ported from it
(``except RuntimeError``) still catches them. :mod:`qkv._door` puts them together at the door
of :func:`qkv.attention`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

Tensor = torch.Tensor

# The dtypes attention is defined for. Half types are accumulated in float32.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class InputValueError(ValueError, RuntimeError):
    """Bad shapes or values: a ValueError, as qkv documents, and a RuntimeError, as torch's
    SDPA raises for the same input, so callers written for either catch it."""


class InputTypeError(TypeError, RuntimeError):
    """Bad types (non-tensors, dtypes): a TypeError, and a RuntimeError as torch raises."""


def callable_name(obj: Any) -> str:
    """How messages and plans name a mask_mod or score_mod: qkv's own objects by their repr
    (``qkv.sliding_window(4)``), functions by ``__name__``, other callables by their type."""
    if type(obj).__module__.startswith("qkv"):
        return repr(obj)
    return getattr(obj, "__name__", None) or type(obj).__name__


def check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise InputTypeError(
            f"{name} must be a torch.Tensor, got {type(t).__name__}; "
            f"wrap it with torch.as_tensor(..., dtype=torch.float32)"
        )
    if t.dtype not in FLOAT_DTYPES:
        raise InputTypeError(
            f"{name} has dtype {t.dtype}; attention needs a floating dtype "
            f"(float16, bfloat16, float32 or float64): convert it with {name}.float()"
        )
    return t


def check_qkv(q: object, k: object, v: object) -> tuple[Tensor, Tensor, Tensor, int]:
    q, k, v = check_tensor("q", q), check_tensor("k", k), check_tensor("v", v)
    ndims = (q.ndim, k.ndim, v.ndim)
    if q.ndim not in (2, 3, 4):
        raise InputValueError(
            f"q has {q.ndim} dims (shape {tuple(q.shape)}); expected [B, H, L, D], "
            f"[H, L, D] or [L, D]"
        )
    if len(set(ndims)) != 1:
        raise InputValueError(
            f"q, k and v must have the same number of dims, got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)} and {tuple(v.shape)}; use [B, H, L, D] for all three"
        )
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise InputTypeError(
            f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}; "
            f"convert them, e.g. k = k.to(q.dtype)"
        )
    if len({q.device, k.device, v.device}) != 1:
        raise InputValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}; "
            f"move them with .to(q.device)"
        )
    orig = q.ndim
    if orig == 2:
        q, k, v = q[None, None], k[None, None], v[None, None]  # [1, 1, L, D]
    elif orig == 3:
        q, k, v = q[None], k[None], v[None]  # [1, H, L, D]
    B, Hq, _, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    Bv, Hv, Lv, _ = v.shape
    if Dk != D:
        raise InputValueError(
            f"q has head dim {D} but k has {Dk} (shapes {tuple(q.shape)} and "
            f"{tuple(k.shape)}); q and k must share their last dim"
        )
    if not (B == Bk == Bv):
        raise InputValueError(
            f"batch sizes differ: q has {B}, k has {Bk}, v has {Bv}; "
            f"all three need the same batch size"
        )
    if Lk != Lv:
        raise InputValueError(
            f"k has length {Lk} but v has {Lv} (shapes {tuple(k.shape)} and "
            f"{tuple(v.shape)}); every key needs exactly one value"
        )
    if Hkv != Hv:
        raise InputValueError(
            f"k has {Hkv} heads but v has {Hv}; k and v need the same number of heads"
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise InputValueError(
            f"q has {Hq} heads and k has {Hkv}: q heads must be a multiple of kv heads "
            f"(grouped-query attention), e.g. Hkv in "
            f"{[d for d in range(1, Hq + 1) if Hq % d == 0] if Hq else [1]}"
        )
    return q, k, v, orig


def default_scale(D: int) -> float:
    """The scale of ``scale=None``: ``1 / sqrt(D)`` (1 for a head dim of 0)."""
    return 1.0 / math.sqrt(D) if D > 0 else 1.0


def check_scale(scale: object, D: int) -> float:
    if scale is None:
        return default_scale(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InputTypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise InputValueError(f"scale must be finite, got {scale}; None means 1/sqrt(head_dim)")
    return float(scale)


def check_dropout(p: object) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise InputTypeError(f"dropout_p must be a float in [0, 1), got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise InputValueError(f"dropout_p must be in [0, 1), got {p}; use 0.0 to turn dropout off")
    return float(p)


def broadcastable(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    # == rather than `in`: symbolic sizes (dynamo's dynamic shapes) compare by value only so
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target), strict=False))


def as_4d(t: Tensor) -> Tensor:
    """Right-align a mask/bias of up to 4 dims against ``[B, Hq, Lq, Lk]``."""
    while t.ndim < 4:
        t = t.unsqueeze(0)
    return t


def _head_dim_hint(
    what: str, shape: tuple[int, ...], target: tuple[int, ...], expr: str = ""
) -> str | None:
    """For a 3-D tensor that does not broadcast to ``target`` (``[B, Hq, Lq, Lk]``) but would
    as ``[B, 1, Lq, Lk]``: the fix. ``[B, Lq, Lk]`` is the mask layout of many codebases (and
    of nn.MultiheadAttention, with B*H); right-aligned it reads as ``[Hq, Lq, Lk]``. (A 3-D
    tensor that does broadcast, such as ``[H, Lq, Lk]`` for ``[H, L, D]`` inputs, is valid
    and never reaches this.)"""
    if len(shape) != 3:
        return None
    with_heads = (shape[0], 1, shape[1], shape[2])
    if not broadcastable(with_heads, target):
        return None
    return (
        f"a [B, Lq, Lk] {what} needs a head dimension: pass {expr or what}[:, None] "
        f"([B, 1, Lq, Lk] = {list(with_heads)})"
    )


def check_mask_tensor(mask: Tensor, q: Tensor, target: tuple[int, int, int, int]) -> Tensor:
    shape = tuple(mask.shape)
    if mask.dtype != torch.bool:
        if mask.is_floating_point():
            hint = None
            if not broadcastable(shape, target):
                hint = _head_dim_hint("bias", shape, target, "score_mod=mask")
            raise InputTypeError(
                f"mask is a {mask.dtype} tensor; masks are bool (True = may attend). An additive "
                f"float bias goes in score_mod=..., e.g. attention(q, k, v, score_mod=bias)"
                + (f"; and of shape {shape}, {hint}" if hint else "")
            )
        raise InputTypeError(
            f"mask has dtype {mask.dtype}; masks are bool tensors (True = may attend): "
            f"use mask.bool() or mask != 0"
        )
    if mask.device != q.device:
        raise InputValueError(
            f"mask is on {mask.device} but q is on {q.device}; use mask.to(q.device)"
        )
    if not broadcastable(shape, target):
        hint = _head_dim_hint("mask", shape, target)
        raise InputValueError(
            f"mask of shape {shape} does not broadcast to [B, Hq, Lq, Lk] = {list(target)}; "
            + (
                hint
                or f"give it shape [Lq, Lk] = [{target[2]}, {target[3]}] or any shape "
                f"broadcastable to the scores"
            )
        )
    return as_4d(mask)


def check_bias_tensor(bias: Tensor, q: Tensor, target: tuple[int, int, int, int]) -> Tensor:
    if not bias.is_floating_point():
        raise InputTypeError(
            f"score_mod tensor has dtype {bias.dtype}; an additive bias must be floating "
            f"(a bool tensor is a mask: pass it as mask=...)"
        )
    if bias.device != q.device:
        raise InputValueError(
            f"score_mod bias is on {bias.device} but q is on {q.device}; use bias.to(q.device)"
        )
    if not broadcastable(tuple(bias.shape), target):
        hint = _head_dim_hint("bias", tuple(bias.shape), target)
        raise InputValueError(
            f"score_mod bias of shape {tuple(bias.shape)} does not broadcast to "
            f"[B, Hq, Lq, Lk] = {list(target)}; "
            + (
                hint
                or f"give it shape [Lq, Lk] = [{target[2]}, {target[3]}] or any shape "
                f"broadcastable to the scores"
            )
        )
    return as_4d(bias)


def check_mask_result(result: object, mod: Callable[..., Any], shape: tuple[int, ...]) -> Tensor:
    """Check what a mask_mod returned for a block of ``shape`` and return it as a 4-D bool.
    The mod is named only in an error (a padding mask's name reads its lengths: a graph
    break while dynamo traces)."""
    if isinstance(result, bool):
        return torch.tensor(result).view(1, 1, 1, 1)
    if not isinstance(result, Tensor):
        name = callable_name(mod)
        raise InputTypeError(
            f"mask_mod {name} returned {type(result).__name__}; it must return a bool tensor "
            f"built from its index arguments (use torch.where / & / | / ~, not Python if/and/or)"
        )
    if result.dtype != torch.bool:
        name = callable_name(mod)
        raise InputTypeError(
            f"mask_mod {name} returned a {result.dtype} tensor; it must return bools "
            f"(True = may attend), e.g. compare with >=, == or use .bool()"
        )
    if not broadcastable(tuple(result.shape), shape):
        name = callable_name(mod)
        raise InputValueError(
            f"mask_mod {name} returned shape {tuple(result.shape)}, which does not broadcast "
            f"to the block {list(shape)} it was asked for; index only with its b, h, q_idx, "
            f"kv_idx arguments so the result broadcasts"
        )
    return as_4d(result)


def check_score_result(
    result: object, mod: Callable[..., Any], shape: tuple[int, ...], dtype: torch.dtype
) -> Tensor:
    """Check what a score_mod returned for scores of ``shape``; cast to the compute dtype."""
    # (named only on an error: a name written from symbolic ints cannot be traced)
    if not isinstance(result, Tensor):
        raise InputTypeError(
            f"score_mod {callable_name(mod)} returned {type(result).__name__}; it must return "
            f"a float tensor computed from its score argument"
        )
    if not result.is_floating_point():
        raise InputTypeError(
            f"score_mod {callable_name(mod)} returned dtype {result.dtype}; it must return floats"
        )
    if not broadcastable(tuple(result.shape), shape):
        name = callable_name(mod)
        raise InputValueError(
            f"score_mod {name} returned shape {tuple(result.shape)}, which does not broadcast "
            f"to the scores {list(shape)}; return a tensor shaped like its score argument"
        )
    return result.to(dtype)

"""``qkv.scaled_dot_product_attention``: torch's SDPA signature, computed by :func:`qkv.attention`.

The same parameters, names, defaults and results as
``torch.nn.functional.scaled_dot_product_attention`` in torch 2.13, so a model written for
torch's function runs on qkv by swapping one name (or, unedited, inside
:func:`qkv.override_sdpa`). This file turns torch's conventions into qkv's (leading batch dims,
heads that broadcast, ``attn_mask`` as a bool mask or an additive bias, ``is_causal``) and
hands masks it recognises to qkv's block-sparse engine (:mod:`qkv._sdpa_masks`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from . import _sdpa_masks
from ._sdpa_checks import (
    SDPATypeError,
    SDPAValueError,
    batch_shape,
    check_types,
    grouped,
    heads,
)
from .functional import attention
from .masks import causal
from .planner import Plan
from .planner import plan as _plan

Tensor = torch.Tensor

__all__ = ["SDPATypeError", "SDPAValueError", "plan", "scaled_dot_product_attention"]

# torch's messages for the two errors a caller may already catch by their text.
_CAUSAL_AND_MASK = "Explicit attn_mask should not be set when is_causal=True"


@dataclass(frozen=True)
class _Call:
    """One SDPA call in qkv's terms: ``qkv.attention(q, k, v, mask, score_mod=bias, ...)``
    and the shape to give the output back in."""

    q: Tensor  # [B, Hq, Lq, D]
    k: Tensor  # [B, Hkv, Lk, D]
    v: Tensor  # [B, Hkv, Lk, Dv]
    mask: Any
    bias: Tensor | None
    out_shape: tuple[int, ...]


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, computed by :func:`qkv.attention`.

    Same parameters, defaults and results as torch 2.13's function, whose plain-PyTorch twin
    (in its docstring) is the specification; :func:`qkv.reference.attention` is qkv's::

        scores = query @ key.transpose(-2, -1) * scale     # [..., Hq, Lq, Lk]
        scores = scores + attn_mask                        # float mask: added
        scores = scores.masked_fill(~attn_mask, -inf)      # bool mask: True = attend
        out = dropout(scores.softmax(-1), dropout_p) @ value   # [..., Hq, Lq, Dv]

    Where torch 2.13 on the CPU and qkv's contract agree, so does this function: a query row
    whose keys are all masked (bool ``False`` or float ``-inf`` everywhere) gives output 0 and
    zero gradients, as torch 2.13 gives on every CPU kernel (its fused kernel and its math
    kernel both return 0, not NaN). Where they differ, qkv's stronger contract holds: a NaN in
    ``query`` reaches that row's output (torch's fused CPU kernel returns 0 for it, swallowing
    the NaN), and the answer never depends on the inputs' memory layout.

    ``is_causal`` is aligned top-left as in torch (query ``i`` sees keys ``0..i`` whatever
    ``Lq`` and ``Lk``: :data:`qkv.causal`). With a mask beside it, torch 2.13 on the CPU keeps
    the keys both allow when its fused kernel runs (4-D inputs with equal batch sizes and heads
    equal or grouped with ``enable_gqa``, ``dropout_p == 0``, a mask that needs no gradient,
    ``Dv == D``, flash enabled in
    ``torch.nn.attention.sdpa_kernel``) and raises
    ``RuntimeError: Explicit attn_mask should not be set when is_causal=True`` otherwise (its
    math kernel); this function does the same in the same cases, except that the layout never
    matters (torch's fused kernel also needs a last-dim stride of 1).

    Masks that qkv recognises run on its block-sparse engine instead of as a dense mask: a bool
    mask (or a float mask of only ``0`` and ``-inf``) that is exactly causal or a band of
    diagonals around the main one goes as :func:`qkv.causal` / :func:`qkv.sliding_window`, a
    key-padding mask ``[B, 1, 1, Lk]`` whose rows are prefixes of ``True`` as
    :func:`qkv.padding`, a mask of all ``True`` as no mask. Reading a mask's values costs one
    pass over it (kept per mask tensor until it changes) and is skipped for problems under
    ``2**16`` scores per head (``Lq * Lk``) and under ``torch.compile``, where values are
    unknown and the mask goes as a bool mask. Any other mask goes as it is: bool as qkv's bool
    mask, float as an additive bias (with gradients). :func:`qkv.torch_sdpa.plan` says what runs.

    Args:
        query: ``[..., Hq, Lq, D]``: any number of leading batch dims (none too: ``[Lq, D]``).
        key: ``[..., Hkv, Lk, D]``; the leading dims broadcast against query's.
        value: ``[..., Hkv, Lk, Dv]``.
        attn_mask: ``None``; a bool tensor (True = attend) or a float tensor added to the
            scores (float32 or query's dtype), broadcastable to ``[..., Hq, Lq, Lk]``; or a
            ``torch.nn.attention.bias.CausalBias`` (``causal_upper_left`` /
            ``causal_lower_right``), read as the bool mask it stands for.
        dropout_p: dropout on the attention probabilities, applied whenever it is > 0 (pass
            0.0 in eval mode, as with torch's function); 1.0 drops everything (output 0).
        is_causal: a top-left causal mask (see above).
        scale: multiplies ``query @ keyᵀ``; default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hkv`` to divide ``Hq`` (grouped-query attention: query head ``h``
            uses key/value head ``h // (Hq // Hkv)``). Without it the heads must be equal or
            1 (broadcast), as in torch.

    Returns:
        ``[..., Hq, Lq, Dv]`` in query's dtype (the broadcast leading dims).

    Raises:
        SDPAValueError / SDPATypeError: bad shapes, values or dtypes, before any work. They
            are ValueError / TypeError as in the rest of qkv and also RuntimeError, the class
            torch's function raises, so existing ``except RuntimeError`` code still works.

    Example::

        >>> import torch, qkv
        >>> q = k = v = torch.randn(2, 4, 128, 32)
        >>> band = torch.ones(128, 128, dtype=torch.bool).tril().triu(-15)   # a window of 16
        >>> out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=band)
        >>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(
        ...     q, k, v, attn_mask=band), atol=1e-5)
        True
    """
    call = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    p = float(dropout_p)
    out = attention(
        call.q,
        call.k,
        call.v,
        call.mask,
        score_mod=call.bias,
        scale=scale,
        dropout_p=0.0 if p == 1.0 else p,
    )
    assert isinstance(out, Tensor)
    if p == 1.0:
        # Every probability dropped: torch returns 0 (qkv.attention refuses p = 1, whose
        # rescale 1 / (1 - p) is infinite).
        out = out * 0.0
    return out.reshape(call.out_shape)  # [..., Hq, Lq, Dv]


def plan(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Plan:
    """What :func:`qkv.scaled_dot_product_attention` would run for these arguments, and why:
    the :class:`qkv.Plan` of the :func:`qkv.attention` call it makes (its mask line shows
    whether a mask was recognised, e.g. ``qkv.sliding_window(255)``).

    Example::

        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 2, 512, 16)
        >>> causal = torch.ones(512, 512, dtype=torch.bool).tril()
        >>> "causal" in str(qkv.torch_sdpa.plan(q, k, v, attn_mask=causal))
        True
    """
    call = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    p = float(dropout_p)
    return _plan(
        call.q,
        call.k,
        call.v,
        call.mask,
        score_mod=call.bias,
        scale=scale,
        dropout_p=0.0 if p == 1.0 else p,
    )


def _prepare(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    dropout_p: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
) -> _Call:
    # torch.nn.attention.bias's CausalBias, a causal mask as a tensor. Looked up, not imported:
    # that module imports torch._dynamo, which `import qkv` must not (a second of start-up,
    # and Triton's interpreter breaks when dynamo comes before its kernels); a CausalBias
    # can only exist once its module was imported.
    bias_module = sys.modules.get("torch.nn.attention.bias")
    if bias_module is not None and isinstance(attn_mask, bias_module.CausalBias):
        if is_causal:
            raise SDPAValueError("CausalBias should not be used with causal=True")  # torch's text
        attn_mask = attn_mask._materialize(query.device)  # [Lq, Lk] bool
    check_types(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    q, k, v = (t if t.dim() >= 3 else t.unsqueeze(0) for t in (query, key, value))  # [..., H, L, D]
    lead = batch_shape(q, k, v)
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    h, hkv = heads(hq, hk, hv, enable_gqa, query, key, value)
    q, k, v = (
        t.expand(*t.shape[:-3], n, *t.shape[-2:])  # [..., n, L, D]: a 1 broadcast, as matmul does
        for t, n in ((q, h), (k, hkv), (v, hkv))
    )
    n_out = max(query.dim(), key.dim(), value.dim())
    lq, lk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    out_shape = (*lead, h, lq, dv) if n_out >= 3 else (lq, dv)
    q4, k4, v4 = (_flatten(t, lead) for t in (q, k, v))  # [B, H, L, D]
    mask: Any = None
    bias: Tensor | None = None
    if attn_mask is not None:
        if attn_mask.dim() > n_out:
            raise SDPAValueError(
                f"scaled_dot_product_attention: attn_mask has shape {tuple(attn_mask.shape)}, "
                f"more dims than the output {out_shape}; give at most {n_out} dims"
            )
        m = _flatten_mask(attn_mask, lead, (h, lq, lk))  # [B or 1, H or 1, Lq or 1, Lk or 1]
        if m.dtype == torch.bool:
            mask = m
        else:
            bias = m
    if is_causal:
        grad_mask = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
        mask = _with_causal(mask, bias, query, key, value, dropout_p, enable_gqa, grad_mask, lq, lk)
    if attn_mask is not None and (isinstance(mask, Tensor) or bias is not None):
        mask, bias = _sdpa_masks.recognise(
            mask, bias, q4.shape[0], lq * lk, attn_mask, bool(is_causal)
        )
    return _Call(q4, k4, v4, mask, bias, out_shape)


def _flatten(t: Tensor, lead: tuple[int, ...]) -> Tensor:
    """``[..., H, L, D]`` with leading dims broadcast to ``lead`` → ``[B, H, L, D]`` (a view
    unless a leading dim had to be broadcast)."""
    t = t.expand(*lead, *t.shape[-3:])  # [*lead, H, L, D]
    if not lead:
        return t.unsqueeze(0)  # [1, H, L, D]
    return t.reshape(-1, *t.shape[-3:])  # [B, H, L, D]


def _flatten_mask(m: Tensor, lead: tuple[int, ...], tail: tuple[int, int, int]) -> Tensor:
    """attn_mask broadcastable to ``[*lead, H, Lq, Lk]`` → ``[B or 1, H or 1, Lq or 1, Lk or 1]``
    (dims of size 1 stay 1, so nothing is materialised that the caller did not)."""
    full = (*lead, *tail)
    try:
        ok = tuple(torch.broadcast_shapes(m.shape, full)) == full
    except RuntimeError:
        ok = False
    if not ok:
        raise SDPAValueError(
            f"scaled_dot_product_attention: attn_mask has shape {tuple(m.shape)}, which does "
            f"not broadcast to the scores' shape {full} ([..., Hq, Lq, Lk]); give a mask of "
            f"that shape or one with 1 in the dims to broadcast"
        )
    m = m.reshape((1,) * (len(full) - m.dim()) + tuple(m.shape))  # [*lead', H', Lq', Lk']
    mlead = m.shape[: len(lead)]
    if all(n == 1 for n in mlead):
        return m.reshape(1, *m.shape[len(lead) :])  # [1, H', Lq', Lk']
    return m.expand(*lead, *m.shape[len(lead) :]).reshape(-1, *m.shape[len(lead) :])  # [B, ...]


def _with_causal(
    mask: Tensor | None,
    bias: Tensor | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float,
    gqa: bool,
    grad_mask: bool,
    lq: int,
    lk: int,
) -> Any:
    """The mask of ``is_causal=True``, alone or beside attn_mask (see the docstring)."""
    if mask is None and bias is None:
        return causal
    fused = (
        query.dim() == key.dim() == value.dim() == 4
        and grouped(query.shape[1], key.shape[1], value.shape[1], gqa)
        and query.shape[0] == key.shape[0] == value.shape[0]
        and dropout_p == 0
        and not grad_mask
        and value.shape[-1] == query.shape[-1]
        and torch.backends.cuda.flash_sdp_enabled()
    )
    if not fused:
        raise SDPAValueError(
            f"scaled_dot_product_attention: {_CAUSAL_AND_MASK} (torch 2.13 refuses both here: "
            f"its math kernel runs, for {query.dim()}-D inputs, broadcast batch or heads, "
            f"dropout_p > 0, a mask that requires grad or Dv != D: here query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}, "
            f"dropout_p={dropout_p}); fold the causal mask into attn_mask"
        )
    if bias is not None:
        return causal  # the float mask stays the bias; causal masks beside it
    assert mask is not None
    tri = torch.ones(lq, lk, dtype=torch.bool, device=mask.device).tril()  # [Lq, Lk]
    return mask & tri  # [B or 1, H or 1, Lq, Lk]

"""The attention function qkv registers in transformers' ``AttentionInterface``.

transformers calls it from every attention layer as
``fn(module, query, key, value, attention_mask, *, dropout, scaling, **kwargs)`` with
``query [B, Hq, Lq, D]`` and ``key``/``value [B, Hkv, Lk, D|Dv]`` at the key/value head count,
and expects ``(out [B, Lq, Hq, Dv], weights [B, Hq, Lq, Lk] | None)`` back. Everything maps onto
one :func:`qkv.attention` call: GQA as it comes (no ``repeat_kv`` copy), ``scaling`` as
``scale``, ``softcap`` as :func:`qkv.softcap` (applied to the scores before the mask, as
Gemma 2's eager path does), a T5-style ``position_bias`` or a user's float 4-D mask as a bias,
``dropout`` as ``dropout_p``. Attention sinks (``s_aux``, GPT-OSS) renormalise each row by its
lse: ``out * exp(lse - logaddexp(lse, sink))``, which is what an extra softmax column does.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch
from torch import nn

from .. import _recording
from ..functional import attention
from ..inspect import weights as inspect_weights
from ..masks import and_masks, causal, document
from ..scores import softcap as softcap_mod
from ..typing import MaskLike, ScoreLike
from ._mask import HFMask

Tensor = torch.Tensor

# Keywords transformers passes through to every attention function that change nothing here:
# bookkeeping for other implementations (flash's packed lengths, paged caches), the output
# flags, and the window (qkv reads it from the mask function instead: see module docstring of
# qkv.hf). Any other keyword is refused rather than ignored.
_IGNORED = frozenset(
    {
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "position_ids",
        "max_length_q",
        "max_length_k",
        "sliding_window",
        "use_cache",
        "cache_position",
        "position_embeddings",
        "cache",
        "past_key_values",
        "past_key_value",
        "layer_idx",
        "num_items_in_batch",
        "seq_idx",
        "kernel_options",
        "deterministic",
        "target_dtype",
        "token_type_ids",
        "return_dict",
        "use_vmap",
    }
)


def _refuse(module: nn.Module, what: str) -> None:
    raise NotImplementedError(
        f"qkv's transformers attention cannot compute {what} of {type(module).__name__}; "
        f"load this model with attn_implementation='eager' or 'sdpa'"
    )


def _check_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if name in _IGNORED or name.startswith("cu_seq_lens") or value is None:
            continue
        _refuse(module, f"the attention keyword {name}={type(value).__name__}")


class _CappedBias:
    """``cap * tanh(score / cap) + bias[b, h, q, kv]``: softcap, then an additive bias."""

    def __init__(self, cap: float | None, bias: Tensor) -> None:
        self.cap, self.bias = cap, bias  # bias [B|1, H|1, Lq|1, Lk|1]

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        if self.cap is not None:
            score = self.cap * torch.tanh(score / self.cap)
        idx = [
            i if n > 1 else torch.zeros_like(i)
            for i, n in zip((b, h, q_idx, kv_idx), self.bias.shape, strict=True)
        ]
        return score + self.bias[idx[0], idx[1], idx[2], idx[3]]

    def __repr__(self) -> str:
        return f"softcap({self.cap}) + bias {list(self.bias.shape)}"


def _mask_and_bias(
    module: nn.Module, attention_mask: object, is_causal: bool | None, Lq: int, Lk: int
) -> tuple[object, Tensor | None, bool]:
    """``(qkv mask, float bias or None, already split into documents)``."""
    if isinstance(attention_mask, HFMask):
        _, _, mq, mk = attention_mask.shape
        if (mq, mk) != (Lq, Lk):
            raise ValueError(
                f"{type(module).__name__} got a qkv mask built for Lq={mq}, Lk={mk} but its "
                f"query and keys have Lq={Lq}, Lk={Lk}; the mask function was called with "
                f"other lengths than the layer's cache holds, so qkv cannot place the mask"
            )
        return attention_mask.mask, None, attention_mask.documents
    if attention_mask is None:
        # transformers gave no mask (its builders were skipped): the module says whether it is
        # causal, as for SDPA's `is_causal` (top-left aligned, and off for one query row).
        causal_ = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        return (causal if causal_ and Lq > 1 else None), None, False
    if isinstance(attention_mask, Tensor):
        if attention_mask.ndim != 4:
            raise ValueError(
                f"{type(module).__name__} passed a {attention_mask.ndim}-D attention_mask of shape "
                f"{list(attention_mask.shape)} to qkv's attention function; it takes qkv's own "
                f"mask (register the mask function too: qkv.hf.register() does both) or a 4-D "
                f"[B, 1, Lq, Lk] mask"
            )
        m = attention_mask[..., :Lk]  # a mask made for a longer (static) cache
        if m.dtype == torch.bool:
            return m, None, False
        return None, m, False  # an additive float mask, as eager adds it
    return attention_mask, None, False  # a FlexAttention BlockMask: qkv converts it


def _documents(kwargs: dict[str, Any], B: int, Lq: int, Lk: int) -> object | None:
    """The document mask of packed sequences given as ``cu_seq_lens_q/k``, or None."""
    cq, ck = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cq is None and ck is None:
        return None
    if cq is None or ck is None or cq.shape != ck.shape or not bool((cq == ck).all()):
        raise NotImplementedError(
            "qkv's transformers attention packs queries and keys the same way: got different "
            "cu_seq_lens_q and cu_seq_lens_k"
        )
    if B != 1 or Lq != Lk or int(cq[-1]) != Lq:
        raise ValueError(
            f"packed sequences (cu_seq_lens_q ending at {int(cq[-1])}) need batch 1 and "
            f"q_len == kv_len == the packed length; got B={B}, Lq={Lq}, Lk={Lk}"
        )
    pos = torch.arange(Lq, device=cq.device)
    ids = torch.searchsorted(cq[1:].to(torch.int64), pos, right=True)  # [Lq] document of each
    return document(ids)


def _collected() -> Any:
    """What transformers' output collector is gathering in this forward (GPT-2 and others do
    not pass ``output_attentions`` down, but the collector knows), or None. The collector's
    module is looked up among the imported ones (transformers imports it with its models),
    which dynamo can trace where it cannot trace an import."""
    module = sys.modules.get("transformers.utils.output_capturing")
    var: Any = getattr(module, "_active_collector", None)
    return None if var is None else var.get()


def _weights_requested(kwargs: dict[str, Any]) -> bool:
    if kwargs.get("output_attentions"):
        return True
    wanted: Any = _collected()
    return bool(wanted) and any(k.endswith("attentions") for k in wanted)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: object,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    position_bias: Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """One transformers attention call on qkv.

    Args:
        module: the calling attention layer (its ``is_causal`` decides when no mask is given).
        query: ``[B, Hq, Lq, D]``.
        key, value: ``[B, Hkv, Lk, D]``, ``[B, Hkv, Lk, Dv]`` (``Hq % Hkv == 0``).
        attention_mask: what qkv's mask function returned, ``None``, or a 4-D bool or
            additive float mask ``[B|1, 1|Hq, Lq, >= Lk]`` a user passed.
        dropout: probability dropout, as the model passes it (0 in eval).
        scaling: score scale (default ``1/sqrt(D)``).
        softcap: Gemma 2's logit cap, applied before the mask.
        s_aux: ``[Hq]`` attention-sink logits.
        position_bias: ``[B|1, Hq|1, Lq, Lk]`` additive bias (T5-style).

    Returns:
        ``(out [B, Lq, Hq, Dv], weights [B, Hq, Lq, Lk] or None)``; the weights when
        ``output_attentions`` is requested, rebuilt from the lse (:func:`qkv.inspect.weights`).
    """
    _check_kwargs(module, kwargs)
    B, _, Lq, _ = query.shape
    Lk = key.shape[2]
    mask, bias, documents = _mask_and_bias(module, attention_mask, is_causal, Lq, Lk)
    if not documents:
        packed = _documents(kwargs, B, Lq, Lk)
        if packed is not None:
            mask = packed if mask is None else and_masks(mask, packed)  # type: ignore[arg-type]
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias
    score_mod: ScoreLike = None
    if bias is not None:
        score_mod = bias if softcap is None else _CappedBias(float(softcap), bias)
    elif softcap is not None:
        score_mod = softcap_mod(float(softcap))

    want_weights = _weights_requested(kwargs)
    need_lse = want_weights or s_aux is not None
    token = _recording.CALLER.set(module) if _recording.current() is not None else None
    try:
        res = attention(
            query,
            key,
            value,
            mask=cast("MaskLike", mask),  # qkv.attention checks it
            score_mod=score_mod,
            scale=scaling,
            dropout_p=float(dropout),
            return_lse=need_lse,
        )
    finally:
        if token is not None:
            _recording.CALLER.reset(token)
    if need_lse:
        out, lse = res  # [B, Hq, Lq, Dv], [B, Hq, Lq]
    else:
        assert isinstance(res, Tensor)
        out, lse = res, None

    weights = None
    if want_weights:
        assert lse is not None
        w = inspect_weights(
            query,
            key,
            lse=lse.detach(),
            mask=cast("MaskLike", mask),
            score_mod=score_mod,
            scale=scaling,
        )  # [B, Hq, Lq, Lk]
    if s_aux is not None:
        assert lse is not None
        sink = s_aux.to(torch.float32).view(1, -1, 1)  # [1, Hq, 1]
        keep = torch.exp(lse - torch.logaddexp(lse, sink))  # [B, Hq, Lq]: 1 - the sink's share
        out = out * keep.unsqueeze(-1).to(out.dtype)
        if want_weights:
            w = w * keep.unsqueeze(-1)
    if want_weights:
        weights = w.to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights  # [B, Lq, Hq, Dv]

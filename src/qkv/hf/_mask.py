"""The mask function qkv registers in transformers' ``AttentionMaskInterface``.

transformers calls it once per forward and mask type (``create_causal_mask``,
``create_sliding_window_causal_mask``, ``create_bidirectional_mask``, ...) and hands what it
returns to every layer's attention function as ``attention_mask``. qkv returns an
:class:`HFMask`: the qkv mask of that buffer (from :mod:`qkv.hf._translate`), never a dense
``[B, 1, Lq, Lk]`` tensor. Masks with no analytic tile rule (a model's own mask_function,
padding with holes) are planned into a :class:`qkv.BlockMask` here, once, so the layers reuse one
tile plan instead of evaluating the mask again in each of them. While ``torch.compile`` traces,
no tile plan is made here (it would read the mask's values): the mask goes to each layer's
:func:`qkv.attention` as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._core.kinds import MaskKind
from .._door import mask_kind
from ..blockmask import block_mask
from ._translate import Frame, _closure, _which, translate

Tensor = torch.Tensor


@dataclass(frozen=True)
class HFMask:
    """What qkv's mask function gives transformers for one forward and mask type.

    Attributes:
        mask: the qkv mask over the attention call's ``[Lq, Lk]`` buffer (``None``: every key).
        shape: ``(B, 1, Lq, Lk)``, the shape transformers' own masks would have (read by code
            that only inspects a mask's size).
        documents: True when the mask already keeps packed sequences apart (position ids that
            restart), so ``cu_seq_lens_*`` keywords add nothing.
    """

    mask: object
    shape: tuple[int, int, int, int]
    documents: bool = False

    @property
    def ndim(self) -> int:
        """4, like transformers' own 4-D masks: a mask prepared ahead (``generate`` does so
        for static caches) is then passed through rather than read as a 2-D padding mask."""
        return 4

    def __repr__(self) -> str:
        return f"qkv.hf mask {list(self.shape)}: {mask_kind(self.mask).name}"


def _needs_evaluation(k: MaskKind) -> bool:
    if k.is_user or k.tensor is not None:
        return True
    return any(_needs_evaluation(p) for p in k.parts)


def _mentions(fn: Any, name: str) -> bool:
    """True if transformers' closure ``name`` appears anywhere in the mask_function tree."""
    if _which(fn) == name:
        return True
    for v in _closure(fn).values():
        items = v if isinstance(v, (list, tuple)) else (v,)
        if any(callable(i) and _mentions(i, name) for i in items):
            return True
    return False


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int | Tensor = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> HFMask:
    """transformers' mask description → :class:`HFMask` (the ``AttentionMaskInterface``
    entry; the other keywords transformers passes — ``local_size``, ``allow_is_causal_skip``,
    ``dtype``, ``config``, ``use_vmap`` — change nothing here: qkv needs no dense mask to skip).

    Args:
        batch_size, q_length, kv_length: the buffer ``[B, Lq, Lk]`` of the coming calls.
        q_offset, kv_offset: absolute position of the first query / key of the buffer.
        mask_function: transformers' ``(batch_idx, head_idx, q_idx, kv_idx) -> bool`` at
            absolute positions.
        attention_mask: the 2-D ``[B, seen + Lq]`` padding mask (True/1 = a real token).
        device: where the model runs.
    """
    from transformers.masking_utils import causal_mask_function

    if isinstance(attention_mask, HFMask):  # prepared ahead for these lengths (static caches)
        want = (batch_size, 1, q_length, kv_length)
        if attention_mask.shape != want:
            raise ValueError(
                f"a qkv mask prepared for {list(attention_mask.shape)} was passed where "
                f"transformers builds one for {list(want)}; let the model build its masks"
            )
        return attention_mask
    fn = causal_mask_function if mask_function is None else mask_function
    frame = Frame(batch_size, q_length, kv_length, int(q_offset), int(kv_offset))
    padding = None if attention_mask is None else attention_mask.to(torch.bool)
    mask = translate(fn, frame, padding)
    kind = mask_kind(mask)
    if _needs_evaluation(kind) and not torch.compiler.is_compiling():
        mask = block_mask(mask, batch_size, None, q_length, kv_length, device=device)
    docs = _mentions(fn, "packed_sequence_mask_function")
    return HFMask(mask, (batch_size, 1, q_length, kv_length), docs)

"""The types of qkv's public signatures: what may be passed as ``mask=`` and ``score_mod=``.

- :data:`MaskMod` ``(b, h, q_idx, kv_idx) -> bool tensor``: True where a query may attend to a
  key (FlexAttention's convention; the indices are broadcastable int64 tensors
  ``b [B,1,1,1]``, ``h [1,H,1,1]``, ``q_idx [1,1,Lq,1]``, ``kv_idx [1,1,1,Lk]``).
- :data:`ScoreMod` ``(score, b, h, q_idx, kv_idx) -> score``: applied to the scaled scores.
- :data:`MaskLike`: a mask_mod, a bool tensor broadcastable to ``[B, Hq, Lq, Lk]``, a
  :class:`qkv.BlockMask`, a FlexAttention ``BlockMask``, or ``None`` (no mask).
- :data:`ScoreLike`: a score_mod, a float bias tensor broadcastable to ``[B, Hq, Lq, Lk]``, or
  ``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias, Union

import torch

from .masks import MaskMod
from .scores import ScoreMod

Tensor = torch.Tensor

__all__ = ["MaskLike", "MaskMod", "ScoreLike", "ScoreMod"]

ScoreLike: TypeAlias = ScoreMod | Tensor | None

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    from .blockmask import BlockMask

    MaskLike: TypeAlias = MaskMod | Tensor | BlockMask | FlexBlockMask | None
else:  # spelled at run time without importing FlexAttention (or qkv.blockmask)
    MaskLike: TypeAlias = Union[MaskMod, Tensor, "BlockMask", "FlexBlockMask", None]

"""Built-in score_mods: ``score_mod(score, b, h, q_idx, kv_idx) -> score``.

A score_mod is applied to the scaled scores ``(q @ kᵀ) * scale`` before masking, with the same
broadcastable int64 index tensors a mask_mod gets. Gradients flow into tensors a score_mod
closes over (ALiBi slopes, a relative-position table), so they can be learned.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._core.builtin_scores import Alibi, RelativeBias, Softcap

Tensor = torch.Tensor
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

__all__ = ["alibi", "alibi_slopes", "relative_bias", "softcap"]


def alibi(slopes: Tensor) -> ScoreMod:
    """ALiBi (Press et al., 2022): ``score + slopes[h] * (kv_idx - q_idx)``.

    ``slopes`` is a ``[H]`` float tensor, one slope per query head (learnable if it requires
    grad). With causal masking, keys further in the past get a linearly growing penalty; for
    ``slopes[h] = 0.5`` query 3's bias over keys 0..3 is ``-1.5 -1.0 -0.5 0``.
    :func:`alibi_slopes` gives the paper's geometric slopes.
    """
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(
            f"alibi slopes must be a 1-D float tensor, got {type(slopes).__name__}; "
            f"qkv.alibi_slopes(n_heads) gives the standard ones"
        )
    if slopes.ndim != 1 or not slopes.is_floating_point():
        raise ValueError(
            f"alibi slopes must be a 1-D float tensor [H], got shape {tuple(slopes.shape)} and "
            f"dtype {slopes.dtype}"
        )
    return Alibi(slopes)


def alibi_slopes(n_heads: int) -> Tensor:
    """The ALiBi paper's slopes ``2^(-8i/n)`` for ``i = 1..n`` (interleaved for non powers of 2).

    Returns a float32 ``[n_heads]`` tensor, one slope per head, for :func:`qkv.alibi`.
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"alibi_slopes needs a positive number of heads, got {n_heads!r}")

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(p)
    if p < n_heads:  # as in the reference implementation: odd entries of the 2p schedule
        slopes += powers(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2, Grok): ``cap * tanh(score / cap)``.

    Keeps every score inside ``(-cap, cap)`` while leaving small scores almost unchanged.
    Elementwise: the score_mod maps scores ``[B, H, Lq, Lk]`` to the same shape.
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        raise TypeError(f"softcap cap must be a number, got {type(cap).__name__}")
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"softcap cap must be a positive finite number, got {cap}")
    return Softcap(float(cap))


def relative_bias(table: Tensor, max_distance: int) -> ScoreMod:
    """Learned relative-position bias: ``score + table[clamp(q_idx - kv_idx, -R, R) + R, h]``.

    ``table`` is a ``[2R+1, H]`` float tensor (``R = max_distance``), usually an
    ``nn.Parameter``; row ``R`` is distance 0, row ``R + d`` is a key ``d`` positions before
    the query, and distances beyond ``R`` share the edge rows. Gradients flow into ``table``.
    """
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
        raise ValueError(f"relative_bias max_distance must be an int >= 0, got {max_distance!r}")
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"relative_bias table must be a float tensor, got {type(table).__name__}")
    if table.ndim != 2 or not table.is_floating_point():
        raise ValueError(
            f"relative_bias table must be a 2-D float tensor [2*max_distance+1, H], got shape "
            f"{tuple(table.shape)} and dtype {table.dtype}"
        )
    if table.shape[0] != 2 * max_distance + 1:
        raise ValueError(
            f"relative_bias table has {table.shape[0]} rows but max_distance={max_distance} "
            f"needs 2*{max_distance}+1 = {2 * max_distance + 1}"
        )
    return RelativeBias(table, max_distance)

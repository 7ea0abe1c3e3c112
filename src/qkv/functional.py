"""``qkv.attention``: validate and classify → one plan → the backend executes it."""

from __future__ import annotations

import torch

from . import _recording, planner
from ._door import validate
from .typing import MaskLike, ScoreLike

Tensor = torch.Tensor


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskLike = None,
    *,
    score_mod: ScoreLike = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention with one contract on every backend.

    Equivalent to :func:`qkv.reference.attention`, the plain formula::

        scores = (q @ k.transpose(-2, -1)) * scale        # [B, Hq, Lq, Lk]
        scores = score_mod(scores, b, h, q_idx, kv_idx)   # or scores + bias
        scores = scores.masked_fill(~mask, -inf)          # mask: True = may attend
        out = scores.softmax(-1) @ v                      # [B, Hq, Lq, Dv]

    with fully masked rows giving 0 instead of NaN, any finite ``scale`` (zero and negative
    too), NaN inputs reaching every row that attends to them (output, lse and gradients, on
    every backend and CPU ISA), and any memory layout of ``q``, ``k``, ``v``. A NaN key or
    value may also reach rows that mask it out where a kernel multiplies the hidden weight 0
    by it in a shared tile (``0 * nan`` is NaN, as in the formula's dense ``probs @ v``); a
    NaN query row never spreads to other rows.

    Args:
        q: queries ``[B, Hq, Lq, D]``; unbatched ``[Hq, Lq, D]`` and ``[Lq, D]`` also work and
            the output has the same number of dims.
        k: keys ``[B, Hkv, Lk, D]``. ``Hq % Hkv == 0``: query head ``h`` uses key/value head
            ``h // (Hq // Hkv)`` (grouped-query attention; ``Hkv = 1`` is multi-query).
        v: values ``[B, Hkv, Lk, Dv]``.
        mask: (may also be passed positionally, as in ``attention(Q, K, V, mask)``)
            ``None``; a bool tensor broadcastable to ``[B, Hq, Lq, Lk]`` (True = may
            attend); a mask_mod ``(b, h, q_idx, kv_idx) -> bool tensor`` such as
            :data:`qkv.causal` (called with broadcastable int64 index tensors, no vmap or
            compile; a mod written for FlexAttention's vmap is evaluated through
            ``torch.vmap`` instead); or a prebuilt ``qkv.BlockMask`` or FlexAttention
            ``BlockMask``.
        score_mod: ``None``; a float bias broadcastable to ``[B, Hq, Lq, Lk]`` added to the
            scaled scores; or ``(score, b, h, q_idx, kv_idx) -> score`` applied to the scaled
            scores before masking. Gradients reach the bias and tensors a score_mod closes over.
        scale: multiplies ``q @ kᵀ``; default ``1 / sqrt(D)``.
        dropout_p: dropout on the attention probabilities (rescaled by ``1 / (1 - p)``).
            Applied whenever it is > 0, as in ``F.scaled_dot_product_attention``.
        return_lse: also return ``lse [B, Hq, Lq]`` (float32; float64 for float64 inputs),
            the natural log of each row's softmax denominator; ``-inf`` for fully masked rows,
            NaN for rows a NaN input reaches.
        backend: ``"auto"`` (default: the fastest backend that computes this exactly),
            ``"sdpa"``, ``"decode"`` (CPU float32, at most 16 query rows per kv head, no
            gradient: qkv's split-key decode kernel), ``"triton"`` (CUDA tensors),
            ``"blocksparse"`` or ``"reference"``. :func:`qkv.plan` says which runs and why.

    Returns:
        ``out [B, Hq, Lq, Dv]`` in q's dtype, or ``(out, lse)``. Half-precision inputs are
        accumulated in float32.

    Example::

        >>> import torch, qkv
        >>> q = torch.randn(2, 8, 128, 64)
        >>> k = v = torch.randn(2, 2, 128, 64)
        >>> qkv.attention(q, k, v, mask=qkv.causal).shape
        torch.Size([2, 8, 128, 64])
    """
    recorder = _recording.current() if _recording.OPEN else None  # qkv.inspect.record()
    if score_mod is None and recorder is None and _no_dropout(dropout_p):
        # A repeat call: its signature's plan was decided (and its arguments checked) before.
        res = planner.repeat(q, k, v, mask, scale, return_lse, backend)
        if res is not None:
            out, lse = res
            return out if not return_lse else (out, lse)  # type: ignore[return-value]
    p = validate(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        dropout_p=dropout_p,
        return_lse=return_lse or recorder is not None,
    )
    plan = planner.decide(p, backend)  # the one decision (kept under the call's signature)
    out, lse = plan.execute(p)
    if recorder is not None:
        assert lse is not None, f"backend {plan.backend} returned no lse although it was asked for"
        recorder.observe(p, lse)
    out = p.restore(out)
    if not return_lse:
        return out
    assert lse is not None, f"backend {plan.backend} returned no lse although it was asked for"
    return out, p.restore(lse)


def _no_dropout(dropout_p: object) -> bool:
    return type(dropout_p) in (float, int) and dropout_p == 0

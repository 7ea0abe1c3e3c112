"""The SDPA backend: ``torch.nn.functional.scaled_dot_product_attention`` where it computes
exactly qkv's contract.

It covers no mask, causal (SDPA's ``is_causal`` is aligned top-left too, whichever object
spells it: ``qkv.causal``, a KV-cache prefill's shifted band, ``and_masks(causal)``), bool
masks, float biases (in q's dtype), GQA, dropout and ``Dv != D``. It cannot apply a callable
score_mod or return the log-sum-exp; for those the planner picks another backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._core.dense import dense_mask
from .._core.problem import Problem
from .base import (
    HUGE_LOGIT,
    Backend,
    Kernel,
    Route,
    Runner,
    fused_cpu_mask,
    imprecise_backward,
    logit_bound,
    score_bytes,
    small_grid,
)

Tensor = torch.Tensor

_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# enable_gqa arrived in torch 2.5, and with it the "safe softmax" that gives fully masked rows
# output 0 instead of NaN (pytorch/pytorch#103749).
_NATIVE_GQA = _VERSION >= (2, 5)
_SAFE_MASKED_ROWS = _VERSION >= (2, 5)


class SdpaBackend(Backend):
    name = "sdpa"

    def rejects(self, p: Problem) -> str | None:
        if p.score.is_callable:
            return "torch's SDPA cannot apply a callable score_mod (only an additive bias tensor)"
        if p.return_lse:
            return "torch's SDPA does not return the log-sum-exp (return_lse=True)"
        if p.Lk == 0:
            return "torch's SDPA needs at least one key (kv_len is 0)"
        if p.score.bias is not None and p.dtype in (torch.float16, torch.bfloat16):
            return f"torch's SDPA would add the bias in {p.dtype}; the contract adds it in float32"
        if not _SAFE_MASKED_ROWS and not (p.mask.is_none or p.mask.is_causal):
            return "torch < 2.5 SDPA gives NaN for fully masked rows"
        return None

    def claims(self, p: Problem) -> str | None:
        if torch.compiler.is_compiling():  # (planning is traced: this is decided at trace time)
            return "torch.compile traces torch's SDPA into the graph"
        return None

    def auto_skip(self, p: Problem) -> str | None:
        # Eagerly a masked problem goes to blocksparse where that backend claims it (its
        # estimated cost below this one's with the dense mask: blocksparse/cost.py). While
        # dynamo traces, the engine's tiles cannot be planned (they read tensor values), so
        # nothing can be weighed: past 2^20 scores the engine's operator takes the mask
        # rather than a dense [Lq, Lk] tensor in the graph (O(n) memory, not O(n^2)).
        masked = not (p.mask.is_none or p.mask.is_causal)
        if masked and torch.compiler.is_compiling() and not small_grid(p):
            return (
                "under torch.compile SDPA would take this mask as a dense [Lq, Lk] tensor in "
                "the graph; the block-sparse engine's operator plans its tiles when it runs"
            )
        return imprecise_backward(p)

    def route(self, p: Problem, *, dry_run: bool = False) -> Route:
        kernel = _kernel(p)
        dense = _dense_mask_bytes(p)
        if kernel.startswith("math"):
            memory = score_bytes(p, 3) + dense
        else:
            memory = dense + p.B * p.Hq * p.Lq * 4
        if _explicit_causal(p):
            forward = f"{kernel}, causal as a dense mask (is_causal gives NaN for scale <= 0)"
        elif p.mask.is_causal:
            forward = f"{kernel}, is_causal"
        elif _folds_groups(p):
            forward = f"{kernel}, each kv head's {p.groups} query heads as {p.groups} query rows"
        elif p.mask.is_none:
            forward = kernel
        elif p.mask.tensor is not None:
            forward = f"{kernel}, the bool mask as a dense float mask"
        else:
            forward = f"{kernel}, the mask evaluated into a dense [Lq, Lk] tensor every call"
        notes: tuple[str, ...] = ()
        # said by qkv.plan only (a call does not read notes: no second pass over q and k)
        bound = logit_bound(p.q, p.k, p.scale) if dry_run and p.requires_grad() else 0.0
        if bound > HUGE_LOGIT:
            notes = (
                f"logits may reach {bound:.3g}: SDPA's backward recomputes them against a "
                f"float32 lse and loses precision beyond {HUGE_LOGIT:g} (auto would take "
                f"blocksparse)",
            )
        return Route(
            forward=forward, backward="torch's SDPA backward", extra_memory=memory, notes=notes
        )

    def run(self, p: Problem, route: Route) -> tuple[Tensor, Tensor | None]:
        q, k, v = p.q, p.k, p.v
        is_causal = p.mask.is_causal and not _explicit_causal(p)
        attn_mask: Tensor | None = None
        if not (p.mask.is_none or p.mask.is_causal) or _explicit_causal(p):
            attn_mask = dense_mask(p)
        if p.score.bias is not None:
            bias = p.score.bias.to(q.dtype)
            if is_causal:  # SDPA takes is_causal or attn_mask, not both
                attn_mask = torch.ones(p.Lq, p.Lk, dtype=torch.bool, device=q.device).tril()
                is_causal = False
            if attn_mask is not None:
                bias = bias.masked_fill(~attn_mask, float("-inf"))
            attn_mask = bias
        if _folds_groups(p):
            return _folded(p)(q, k, v)
        gqa = p.groups > 1 and _NATIVE_GQA
        if p.groups > 1 and not _NATIVE_GQA:
            k = k.repeat_interleave(p.groups, dim=1)  # [B, Hq, Lk, D]
            v = v.repeat_interleave(p.groups, dim=1)  # [B, Hq, Lk, Dv]
        out = _sdpa(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=p.dropout_p,
            is_causal=is_causal,
            scale=p.scale,
            enable_gqa=gqa,
        )  # [B, Hq, Lq, Dv]
        return out, None

    def runner(self, p: Problem, route: Route) -> Runner | None:
        if not p.score.is_none or p.dropout_p > 0:
            return None
        if _folds_groups(p) and not p.requires_grad():
            return _folded(p)
        if p.groups > 1 and not _NATIVE_GQA:
            return None
        gqa, scale = p.groups > 1, p.scale
        causal = p.mask.is_causal and not _explicit_causal(p)
        # Any other mask as the dense tensor run() would build, once: the caller keys a kept
        # runner on the mask object and its tensors' versions (qkv._planning.signature), so it
        # stays valid.
        attn = None if p.mask.is_none or causal else _additive(dense_mask(p), p.q.dtype)
        # (a call whose gradients SDPA's backward would get imprecisely, with huge logits,
        # is not this runner's: the planner keeps plans per answer of that check)

        # What _sdpa decides per call, once: the signature fixes the shapes, dtype and device
        # (a small call's 110 us spent ~1.3 us there)
        attn, causal = fused_cpu_mask(p.q, p.Lq, p.Lk, attn, causal)
        sdpa = F.scaled_dot_product_attention
        if gqa:

            def run_gqa(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None] | None:
                return sdpa(q, k, v, attn, 0.0, causal, scale=scale, enable_gqa=True), None

            return run_gqa

        def run(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None] | None:
            return sdpa(q, k, v, attn, 0.0, causal, scale=scale), None  # [B, Hq, Lq, Dv]

        return run


# Masks up to this many elements are kept by a runner as the additive float mask SDPA would
# make of a bool one at every call (4 MiB in float32): SDPA then skips that step, 4-10% of a
# small masked call (B=4 H=4 L=48 D=32, benchmarks/RESULTS.md), with identical results and
# gradients (fully masked rows included). Larger masks stay bool: a kept plan holds them.
ADDITIVE_LIMIT = 1 << 20


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A bool mask (True = attend) as SDPA's additive float mask (0 or -inf) of ``dtype``,
    when it is small enough to keep (:data:`ADDITIVE_LIMIT`); else as it is."""
    if mask is None or mask.dtype != torch.bool or mask.numel() > ADDITIVE_LIMIT:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` with a NaN kept where torch's fused CPU kernel would
    drop it (a mask-free call over fewer than 16 keys: see ``fused_cpu_mask``)."""
    attn_mask, is_causal = fused_cpu_mask(q, q.shape[-2], k.shape[-2], attn_mask, is_causal)
    if enable_gqa:  # (torch before 2.5 has no such argument; qkv then repeats k and v)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=True
        )  # [..., Lq, Dv]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale
    )  # [..., Lq, Dv]


def _folded(p: Problem) -> Kernel:
    """One query row per head, no mask: a kv head's query heads are just more rows of one
    problem, so SDPA runs on the kv heads as they are (a view, no GQA expansion: 10-15% faster
    than enable_gqa at 1k-4k cached keys on one thread, measured in RESULTS.md)."""
    B, Hkv, g, D, Hq, Dv, scale = p.B, p.Hkv, p.groups, p.D, p.Hq, p.Dv, p.scale

    def run(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None]:
        qf = q.reshape(B, Hkv, g, D)  # [B, Hkv, g, D]: a view of [B, Hq, 1, D]
        of = _sdpa(qf, k, v, scale=scale)  # [B, Hkv, g, Dv]
        return of.reshape(B, Hq, 1, Dv), None  # [B, Hq, 1, Dv]

    return run


def _explicit_causal(p: Problem) -> bool:
    """Causal with ``scale <= 0``: torch's ``is_causal`` kernels give NaN there (torch 2.13,
    CPU flash and math alike), an explicit mask does not."""
    return p.mask.is_causal and p.scale <= 0


def _folds_groups(p: Problem) -> bool:
    """Decoding with GQA: one query row, no mask, no bias, no dropout."""
    return (
        p.groups > 1 and p.Lq == 1 and p.mask.is_none and p.score.bias is None and p.dropout_p == 0
    )


def _kernel(p: Problem) -> str:
    """Which of torch's CPU kernels SDPA will use for this problem (a best guess)."""
    if p.dropout_p > 0:
        return "math (SDPA's unfused path: dropout)"
    if p.score.bias is not None and p.score.bias.requires_grad:
        return "math (SDPA's unfused path: a bias that needs a gradient)"
    if p.Dv != p.D:
        return "math (SDPA's unfused path: value dim differs from head dim)"
    return "flash (fused)"


def _dense_mask_bytes(p: Problem) -> int:
    if p.mask.is_none or (p.mask.is_causal and not _explicit_causal(p)):
        return 0
    n = p.B * p.Hq * p.Lq * p.Lk
    # SDPA turns a bool mask into an additive float mask of q's dtype; a mask_mod is first
    # evaluated into a bool tensor of up to the full score shape.
    own = 0 if p.mask.tensor is not None else n
    return own + n * p.q.element_size()

"""The SDPA backend: ``torch.nn.functional.scaled_dot_product_attention`` where it computes
exactly qkv's contract.

It covers no mask, ``qkv.causal`` (SDPA's ``is_causal`` is aligned top-left too), bool masks,
float biases (in q's dtype), GQA, dropout and ``Dv != D``. It cannot apply a callable
score_mod or return the log-sum-exp; for those ``qkv.plan`` picks another backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._dense import dense_mask
from .._validate import Problem
from ..masks import causal
from .base import Backend, score_bytes

Tensor = torch.Tensor

_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# enable_gqa arrived in torch 2.5, and with it the "safe softmax" that gives fully masked rows
# output 0 instead of NaN (pytorch/pytorch#103749).
_NATIVE_GQA = _VERSION >= (2, 5)
_SAFE_MASKED_ROWS = _VERSION >= (2, 5)


class SdpaBackend(Backend):
    name = "sdpa"

    def rejects(self, p: Problem) -> str | None:
        sm = p.score_mod
        if sm is not None and not isinstance(sm, Tensor):
            return "torch's SDPA cannot apply a callable score_mod (only an additive bias tensor)"
        if p.return_lse:
            return "torch's SDPA does not return the log-sum-exp (return_lse=True)"
        if p.Lk == 0:
            return "torch's SDPA needs at least one key (kv_len is 0)"
        if isinstance(sm, Tensor) and p.dtype in (torch.float16, torch.bfloat16):
            return f"torch's SDPA would add the bias in {p.dtype}; the contract adds it in float32"
        if not _SAFE_MASKED_ROWS and p.mask is not None and p.mask is not causal:
            return "torch < 2.5 SDPA gives NaN for fully masked rows"
        return None

    def kernel(self, p: Problem) -> str:
        """Which of torch's CPU kernels SDPA will use for this problem (a best guess)."""
        if p.dropout_p > 0:
            return "math (SDPA's unfused path: dropout)"
        if isinstance(p.score_mod, Tensor) and p.score_mod.requires_grad:
            return "math (SDPA's unfused path: a bias that needs a gradient)"
        if p.Dv != p.D:
            return "math (SDPA's unfused path: value dim differs from head dim)"
        return "flash (fused)"

    def _dense_mask_bytes(self, p: Problem) -> int:
        m = p.mask
        if m is None or m is causal:
            return 0
        n = p.B * p.Hq * p.Lq * p.Lk
        # SDPA turns a bool mask into an additive float mask of q's dtype; a mask_mod is first
        # evaluated into a bool tensor of up to the full score shape.
        own = 0 if isinstance(m, Tensor) else n
        return own + n * p.q.element_size()

    def extra_memory(self, p: Problem) -> int:
        if self.kernel(p).startswith("math"):
            return score_bytes(p, 3) + self._dense_mask_bytes(p)
        return self._dense_mask_bytes(p) + p.B * p.Hq * p.Lq * 4

    def run(self, p: Problem) -> tuple[Tensor, Tensor | None]:
        q, k, v = p.q, p.k, p.v
        is_causal = p.mask is causal
        attn_mask: Tensor | None = None
        if p.mask is not None and not is_causal:
            attn_mask = dense_mask(p)
        if isinstance(p.score_mod, Tensor):
            bias = p.score_mod.to(q.dtype)
            if is_causal:  # SDPA takes is_causal or attn_mask, not both
                attn_mask = torch.ones(p.Lq, p.Lk, dtype=torch.bool, device=q.device).tril()
                is_causal = False
            if attn_mask is not None:
                bias = bias.masked_fill(~attn_mask, float("-inf"))
            attn_mask = bias
        kwargs = {}
        if p.groups > 1:
            if _NATIVE_GQA:
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(p.groups, dim=1)  # [B, Hq, Lk, D]
                v = v.repeat_interleave(p.groups, dim=1)  # [B, Hq, Lk, Dv]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=p.dropout_p,
            is_causal=is_causal,
            scale=p.scale,
            **kwargs,
        )  # [B, Hq, Lq, Dv]
        return out, None

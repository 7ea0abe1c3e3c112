"""A plain, independent re-implementation of ``qkv.MultiHeadAttention`` for tests.

It takes a module's weights and recomputes its forward with ``F.linear``, a complex-number
RoPE (not the rotate-half code under test), an explicit RMS norm and the oracle
:func:`qkv.reference.attention`, in any dtype: float64 is the oracle, the module's own dtype
is the "plain PyTorch" error baseline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import qkv

Tensor = torch.Tensor


def plain_rope(x: Tensor, positions: Tensor, dim: int, base: float) -> Tensor:
    """Rotate feature pairs ``(x[i], x[i + dim/2])`` as complex numbers by ``pos * θ_i``."""
    half = dim // 2
    cdt = torch.complex128 if x.dtype == torch.float64 else torch.complex64
    rdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    theta = base ** (-torch.arange(0, dim, 2, dtype=rdt) / dim)  # [half]
    ang = positions.to(rdt)[:, None] * theta  # [L, half]
    rot = torch.polar(torch.ones_like(ang), ang).to(cdt)  # [L, half]
    z = torch.complex(x[..., :half], x[..., half:dim]).to(cdt) * rot  # [..., L, half]
    return torch.cat((z.real.to(x.dtype), z.imag.to(x.dtype), x[..., dim:]), dim=-1)


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def plain_mha(
    mha: qkv.MultiHeadAttention,
    x_q: Tensor,
    x_kv: Tensor | None = None,
    *,
    mask: object = None,
    score_mod: object = None,
    dtype: torch.dtype = torch.float64,
    params: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out [B, Lq, d_model], weights [B, H, Lq, Lk])`` for batched inputs, in ``dtype``.

    ``params`` (name -> tensor, e.g. float64 leaf copies) replaces the module's parameters."""
    p = params if params is not None else dict(mha.named_parameters())
    p = {n: t.to(dtype) for n, t in p.items()}
    x_q = x_q.to(dtype)
    x_kv = x_q if x_kv is None else x_kv.to(dtype)
    B, Lq, _ = x_q.shape
    Lk = x_kv.shape[1]
    H, Hkv, D = mha.n_heads, mha.n_kv_heads, mha.head_dim

    def lin(name: str, x: Tensor) -> Tensor:
        return F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias"))

    q = lin("q_proj", x_q).view(B, Lq, H, D).transpose(1, 2)  # [B, H, Lq, D]
    k = lin("k_proj", x_kv).view(B, Lk, Hkv, D).transpose(1, 2)  # [B, Hkv, Lk, D]
    v = lin("v_proj", x_kv).view(B, Lk, Hkv, D).transpose(1, 2)  # [B, Hkv, Lk, D]
    if mha.q_norm is not None:
        q = _rms(q, p["q_norm.weight"], 1e-6)
        k = _rms(k, p["k_norm.weight"], 1e-6)
    if mha.rope is not None:
        q = plain_rope(q, torch.arange(Lq), mha.rope.dim, mha.rope.base)
        k = plain_rope(k, torch.arange(Lk), mha.rope.dim, mha.rope.base)
    o, w = qkv.reference.attention(q, k, v, mask=mask, score_mod=score_mod)  # [B, H, Lq, D]
    o = o.transpose(1, 2).reshape(B, Lq, H * D)  # [B, Lq, H*D]
    return lin("out_proj", o), w

"""qkv.MultiHeadAttention.from_torch / to_torch: outputs and weights equal torch's module.

The parity tests run in float64 (the same formula must give the same numbers), and once in
float32 against a float64 ground truth with the house error ratio.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkv

Tensor = torch.Tensor


def _err(a: Tensor, b: Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _torch_mha(E=24, H=4, *, bias=True, kdim=None, vdim=None, batch_first=True, dtype=None):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(
        E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first, dtype=dtype
    )
    if bias:  # torch zero-initialises the biases: make them matter
        with torch.no_grad():
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    return m.eval()


def _run_torch(m, q, k, v, **kw):
    """torch's module on batch-first inputs, whatever its batch_first; weights per head."""
    if not m.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out, w = m(q, k, v, need_weights=True, average_attn_weights=False, **kw)
    return (out if m.batch_first else out.transpose(0, 1)), w


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_parity(batch_first, bias):
    dt = torch.float64
    m = _torch_mha(bias=bias, batch_first=batch_first, dtype=dt)
    mha = qkv.MultiHeadAttention.from_torch(m)
    assert mha.q_proj.weight.dtype == dt and (mha.q_proj.bias is not None) == bias
    x = torch.randn(3, 7, 24, dtype=dt)
    to, tw = _run_torch(m, x, x, x)
    out, w = mha(x, need_weights=True)
    assert _err(out, to) < 1e-12 and _err(w, tw) < 1e-12


@pytest.mark.parametrize("batch_first", [True, False])
def test_causal_parity(batch_first):
    dt = torch.float64
    m = _torch_mha(batch_first=batch_first, dtype=dt)
    mha = qkv.MultiHeadAttention.from_torch(m)
    x = torch.randn(2, 9, 24, dtype=dt)
    blocked = torch.ones(9, 9, dtype=torch.bool).triu(1)  # torch: True = may NOT attend
    to, tw = _run_torch(m, x, x, x, attn_mask=blocked)
    out, w = mha(x, mask=qkv.causal, need_weights=True)
    assert _err(out, to) < 1e-12 and _err(w, tw) < 1e-12
    assert _err(mha(x, mask=~blocked), to) < 1e-12
    to2, _ = _run_torch(m, x, x, x, attn_mask=blocked, is_causal=True)
    assert _err(out, to2) < 1e-12


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [None, 10], ids=["kdim=d_model", "kdim=10"])
def test_cross_attention_with_key_padding_parity(batch_first, kdim):
    dt = torch.float64
    m = _torch_mha(kdim=kdim, vdim=kdim, batch_first=batch_first, dtype=dt)
    mha = qkv.MultiHeadAttention.from_torch(m)
    width = kdim or 24
    x, ctx = torch.randn(3, 5, 24, dtype=dt), torch.randn(3, 8, width, dtype=dt)
    kpm = torch.arange(8)[None, :] >= torch.tensor([8, 5, 1])[:, None]  # [B, Lk], True = pad
    to, tw = _run_torch(m, x, ctx, ctx, key_padding_mask=kpm)
    out, w = mha(x, ctx, mask=~kpm[:, None, None, :], need_weights=True)
    assert _err(out, to) < 1e-12 and _err(w, tw) < 1e-12
    assert _err(mha(x, ctx, mask=qkv.padding(torch.tensor([8, 5, 1]))), to) < 1e-12


def test_separate_key_and_value_tensors_parity():
    dt = torch.float64
    m = _torch_mha(kdim=10, vdim=6, dtype=dt)
    mha = qkv.MultiHeadAttention.from_torch(m)
    x, xk, xv = (torch.randn(2, n, w, dtype=dt) for n, w in ((4, 24), (7, 10), (7, 6)))
    to, tw = _run_torch(m, x, xk, xv)
    out, w = mha(x, (xk, xv), need_weights=True)
    assert _err(out, to) < 1e-12 and _err(w, tw) < 1e-12


def test_float_and_per_head_attn_masks_parity():
    dt = torch.float64
    m = _torch_mha(dtype=dt)
    mha = qkv.MultiHeadAttention.from_torch(m)
    B, H, L = 2, 4, 6
    x = torch.randn(B, L, 24, dtype=dt)
    bias = torch.randn(L, L, dtype=dt)
    assert _err(mha(x, score_mod=bias), _run_torch(m, x, x, x, attn_mask=bias)[0]) < 1e-12
    blocked = torch.rand(B * H, L, L) < 0.3
    blocked[..., 0] = False  # keep one key per row (torch gives NaN for empty rows)
    to, tw = _run_torch(m, x, x, x, attn_mask=blocked)
    out, w = mha(x, mask=~blocked.view(B, H, L, L), need_weights=True)
    assert _err(out, to) < 1e-12 and _err(w, tw) < 1e-12


def test_float32_parity_within_error_ratio():
    """In float32, qkv's error against the float64 ground truth is within 2x of torch's."""
    m32 = _torch_mha(dtype=torch.float32)
    m64 = _torch_mha(dtype=torch.float64)
    m64.load_state_dict({k: v.double() for k, v in m32.state_dict().items()})
    mha = qkv.MultiHeadAttention.from_torch(m32)
    x, ctx = torch.randn(2, 33, 24), torch.randn(2, 47, 24)
    truth, _ = _run_torch(m64, x.double(), ctx.double(), ctx.double())
    ours, theirs = mha(x, ctx), _run_torch(m32, x, ctx, ctx)[0]
    assert _err(ours, truth) <= 2 * _err(theirs, truth) + 1e-6


@pytest.mark.parametrize("kdim", [None, 10])
@pytest.mark.parametrize("bias", [True, False])
def test_to_torch_round_trip(kdim, bias):
    torch.manual_seed(0)
    dt = torch.float64
    mha = qkv.MultiHeadAttention(24, 4, kdim=kdim, vdim=kdim, bias=bias, dtype=dt)
    m = mha.to_torch(batch_first=False).eval()
    assert not m.batch_first
    x, ctx = torch.randn(2, 5, 24, dtype=dt), torch.randn(2, 6, kdim or 24, dtype=dt)
    out, w = mha(x, ctx, need_weights=True)
    to, tw = _run_torch(m, x, ctx, ctx)
    assert _err(out, to) < 1e-12 and _err(w, tw) < 1e-12
    back = qkv.MultiHeadAttention.from_torch(m)
    assert all(torch.equal(a, b) for a, b in zip(back.parameters(), mha.parameters(), strict=True))


def test_from_torch_keeps_dropout_and_mode():
    m = nn.MultiheadAttention(16, 2, dropout=0.25)
    mha = qkv.MultiHeadAttention.from_torch(m)
    assert mha.dropout == 0.25 and mha.training
    assert not qkv.MultiHeadAttention.from_torch(m.eval()).training


def test_conversion_refusals():
    with pytest.raises(ValueError, match="add_bias_kv"):
        qkv.MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        qkv.MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 2, add_zero_attn=True))
    with pytest.raises(TypeError, match="Linear"):
        qkv.MultiHeadAttention.from_torch(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_kv_heads=2 < n_heads=4"):
        qkv.MultiHeadAttention(16, 4, n_kv_heads=2).to_torch()
    with pytest.raises(ValueError, match="rope"):
        qkv.MultiHeadAttention(16, 4, rope=True).to_torch()
    with pytest.raises(ValueError, match="qk_norm"):
        qkv.MultiHeadAttention(16, 4, qk_norm=True).to_torch()

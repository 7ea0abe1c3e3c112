"""The behaviours the teaching text demonstrates, written as our own tests: projections from one
embedding matrix, rows of weights that sum to 1, causal zeros above the diagonal, non-square
cross-attention, heads as an extra tensor dimension, and why the scores are scaled."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv import attention


@pytest.fixture
def tokens():
    gen = torch.Generator().manual_seed(7)
    n, d_model, d_k, d_v = 5, 12, 6, 4
    x = torch.randn(n, d_model, generator=gen)  # [n, d_model]
    w_q = torch.randn(d_model, d_k, generator=gen)  # [d_model, d_k]
    w_k = torch.randn(d_model, d_k, generator=gen)  # [d_model, d_k]
    w_v = torch.randn(d_model, d_v, generator=gen)  # [d_model, d_v]
    return x, w_q, w_k, w_v


def three_steps(q, k, v, keep=None):
    """Our own plain formula: score, softmax, blend (keep: True = may attend)."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s.softmax(-1) @ v


def test_two_dim_self_attention_matches_the_formula(tokens):
    x, w_q, w_k, w_v = tokens
    q, k, v = x @ w_q, x @ w_k, x @ w_v  # [n, d_k], [n, d_k], [n, d_v]
    out = attention(q, k, v)
    assert out.shape == (5, 4)  # one blended d_v-vector per token
    assert torch.allclose(out, three_steps(q, k, v), atol=1e-5)
    _, w = qkv.reference.attention(q, k, v)
    assert torch.allclose(w.sum(-1), torch.ones(5), atol=1e-6)  # each row sums to 1
    assert ((w > 0) & (w < 1)).all()  # a soft lookup: everyone gets some weight


def test_builtin_sdpa_agrees(tokens):
    x, w_q, w_k, w_v = tokens
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    want = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    assert torch.allclose(attention(q, k, v), want, atol=1e-5)


def test_causal_self_attention_has_zeros_above_the_diagonal(tokens):
    x, w_q, w_k, w_v = tokens
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    lower = torch.ones(5, 5, dtype=torch.bool).tril()  # [n, n] True = may attend
    _, w = qkv.reference.attention(q, k, v, mask=lower)
    assert torch.equal(w.triu(1), torch.zeros(5, 5))
    assert w[0, 0] == 1.0  # the first token can only see itself
    assert torch.allclose(w.sum(-1), torch.ones(5), atol=1e-6)
    # a bool tensor passed positionally (the text's call style) and qkv.causal agree
    by_tensor = attention(q, k, v, lower)
    assert torch.allclose(by_tensor, attention(q, k, v, mask=qkv.causal), atol=1e-6)
    assert torch.allclose(by_tensor, three_steps(q, k, v, lower), atol=1e-5)


def test_cross_attention_scores_are_not_square(tokens):
    _, w_q, w_k, w_v = tokens
    gen = torch.Generator().manual_seed(3)
    dec = torch.randn(3, 12, generator=gen)  # [n_dec, d_model] decoder states
    enc = torch.randn(7, 12, generator=gen)  # [n_enc, d_model] encoder output
    q, k, v = dec @ w_q, enc @ w_k, enc @ w_v
    out, w = qkv.reference.attention(q, k, v)
    assert w.shape == (3, 7)  # every decoder token against every encoder token
    assert out.shape == (3, 4)
    assert torch.allclose(attention(q, k, v), three_steps(q, k, v), atol=1e-5)


def test_heads_are_an_extra_tensor_dimension(tokens):
    x, *_ = tokens
    gen = torch.Generator().manual_seed(5)
    h, d_model = 3, 12
    d_k = d_model // h
    w_q, w_k, w_v = (torch.randn(d_model, d_model, generator=gen) for _ in range(3))

    def split(t):  # [n, d_model] -> [h, n, d_k]
        return t.view(t.shape[0], h, d_k).transpose(0, 1)

    q, k, v = split(x @ w_q), split(x @ w_k), split(x @ w_v)
    lower = torch.ones(5, 5, dtype=torch.bool).tril()
    all_heads = attention(q, k, v, lower)  # [h, n, d_k]: all heads in one call
    one_by_one = torch.stack([three_steps(q[i], k[i], v[i], lower) for i in range(h)])
    assert all_heads.shape == (h, 5, d_k)
    assert torch.allclose(all_heads, one_by_one, atol=1e-5)
    concat = all_heads.transpose(0, 1).reshape(5, d_model)  # [n, h * d_k] = [n, d_model]
    assert concat.shape == x.shape


def test_text_style_module_runs_on_qkv_attention():
    """A minimal multi-head module written the way the text builds it, calling qkv.attention
    with a positional mask on 3-D [h, n, d_k] tensors: self- and cross-attention."""

    class TinyMHA(torch.nn.Module):
        def __init__(self, d_model, n_heads):
            super().__init__()
            self.h, self.d_k = n_heads, d_model // n_heads
            self.proj = torch.nn.ModuleList(
                torch.nn.Linear(d_model, d_model, bias=False) for _ in range(4)
            )

        def heads(self, t):  # [n, d_model] -> [h, n, d_k]
            return t.view(t.shape[0], self.h, self.d_k).transpose(0, 1)

        def forward(self, x_q, x_kv, mask=None):
            q, k, v = (self.heads(self.proj[i](x)) for i, x in enumerate((x_q, x_kv, x_kv)))
            out = attention(q, k, v, mask)  # [h, n_q, d_k]
            return self.proj[3](out.transpose(0, 1).reshape(x_q.shape[0], -1))

    torch.manual_seed(0)
    mha = TinyMHA(8, 2)
    x, enc = torch.randn(4, 8), torch.randn(6, 8)
    assert mha(x, x).shape == (4, 8)
    assert mha(x[:3], enc).shape == (3, 8)
    causal = mha(x, x, torch.ones(4, 4, dtype=torch.bool).tril())
    # causal: the first token's output depends on itself only
    assert torch.allclose(causal[0], mha(x[:1], x[:1])[0], atol=1e-6)


def captured_scores(q, k):
    seen = []

    def spy(score, b, h, q_idx, kv_idx):
        seen.append(score.detach())
        return score

    qkv.attention(q, k, k, score_mod=spy)
    return seen[0]


@pytest.mark.parametrize("d_k", [4, 64, 512])
def test_scaling_keeps_score_spread_near_one_whatever_the_width(d_k):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2000, d_k, generator=gen), torch.randn(50, d_k, generator=gen)
    raw = (q @ k.T).std().item()
    scaled = captured_scores(q, k).std().item()  # score_mod sees the scaled scores
    assert raw == pytest.approx(math.sqrt(d_k), rel=0.1)  # unscaled spread grows like √d_k
    assert scaled == pytest.approx(1.0, rel=0.1)


def test_unscaled_scores_saturate_the_softmax():
    s = torch.tensor([[2.0, 1.0, 0.5]])
    v = torch.eye(3)
    gentle = attention(torch.ones(1, 1), torch.ones(3, 1), v, score_mod=lambda x, *_: s)
    sharp = attention(torch.ones(1, 1), torch.ones(3, 1), v, score_mod=lambda x, *_: s * 8)
    assert gentle.max() < 0.7 and sharp.max() > 0.999  # v = I: out is the weight row

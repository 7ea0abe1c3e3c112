"""Property-based tests of the contract on random small problems (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from catalogue import index_tensors

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def problems(draw, min_lk=0):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    Hq = Hkv * draw(st.integers(1, 3))
    Lq = draw(st.integers(0, 9))
    Lk = draw(st.integers(min_lk, 9))
    D = draw(st.integers(1, 8))
    Dv = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=gen, dtype=dtype) * draw(st.sampled_from([0.1, 1, 5]))
    k = torch.randn(B, Hkv, Lk, D, generator=gen, dtype=dtype)
    v = torch.randn(B, Hkv, Lk, Dv, generator=gen, dtype=dtype)
    kind = draw(st.sampled_from(["none", "bool", "causal", "window", "head_mod", "prefix"]))
    mask = {
        "none": None,
        "bool": torch.rand(B, 1, Lq, Lk, generator=gen) > 0.4,
        "causal": qkv.causal,
        "window": qkv.sliding_window(draw(st.integers(0, 3)), draw(st.integers(0, 3))),
        "head_mod": lambda b, h, qi, ki: (ki + h) % 3 != 0,
        "prefix": qkv.prefix_lm(draw(st.integers(0, 4))),
    }[kind]
    return q, k, v, mask


def _tol(dtype):
    return 1e-10 if dtype == torch.float64 else 2e-5


@SETTINGS
@given(problems())
def test_auto_equals_oracle(prob):
    q, k, v, mask = prob
    out, lse = qkv.attention(q, k, v, mask=mask, return_lse=True)
    ref, w = qkv.reference.attention(q.double(), k.double(), v.double(), mask=mask)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.allclose(out.double(), ref, atol=_tol(q.dtype), rtol=0)
    # lse is the log of the softmax denominator: -inf exactly where the row sees nothing
    sees = w.sum(-1) > 0
    assert torch.equal(torch.isfinite(lse), sees)
    sdpa_ok = qkv.attention(q, k, v, mask=mask)  # auto without lse may pick sdpa
    assert torch.allclose(sdpa_ok.double(), ref, atol=_tol(q.dtype), rtol=0)


@SETTINGS
@given(problems())
def test_weights_are_distributions_over_visible_keys(prob):
    q, k, v, mask = prob
    _, w = qkv.reference.attention(q, k, v, mask=mask)
    row = w.sum(-1)
    assert torch.all(((row - 1).abs() < 1e-5) | (row == 0))
    assert (w >= 0).all()


@SETTINGS
@given(problems(min_lk=1), st.data())
def test_permuting_keys_with_their_values_changes_nothing(prob, data):
    q, k, v, mask = prob
    if callable(mask):  # positional masks move with positions; use their dense form
        _, w = qkv.reference.attention(q, k, v, mask=mask)
        mask = mask(*index_tensors(*w.shape)).expand(w.shape)
    perm = torch.tensor(data.draw(st.permutations(range(k.shape[2]))))
    out = qkv.attention(q, k, v, mask=mask)
    pmask = None if mask is None else mask[..., perm]
    out_p = qkv.attention(q, k[:, :, perm], v[:, :, perm], mask=pmask)
    assert torch.allclose(out, out_p, atol=_tol(q.dtype), rtol=0)


@SETTINGS
@given(problems(), st.floats(-50, 50))
def test_adding_a_constant_to_every_score_shifts_only_lse(prob, c):
    q, k, v, mask = prob
    out, lse = qkv.attention(q, k, v, mask=mask, return_lse=True)
    out_c, lse_c = qkv.attention(
        q, k, v, mask=mask, score_mod=lambda s, b, h, qi, ki: s + c, return_lse=True
    )
    assert torch.allclose(out, out_c, atol=_tol(q.dtype) * 10, rtol=0)
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(lse_c))
    assert torch.allclose(lse_c[finite], lse[finite] + c, atol=1e-4, rtol=1e-5)


@SETTINGS
@given(problems())
def test_gqa_equals_repeated_kv_heads(prob):
    q, k, v, mask = prob
    g = q.shape[1] // k.shape[1]
    out = qkv.attention(q, k, v, mask=mask)
    rep = qkv.attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), mask=mask)
    assert torch.allclose(out, rep, atol=_tol(q.dtype), rtol=0)


@SETTINGS
@given(problems(), st.floats(0.05, 3.0))
def test_scale_multiplies_the_scores(prob, s):
    q, k, v, mask = prob
    a = qkv.attention(q, k, v, mask=mask, scale=s)
    b = qkv.attention(q * s, k, v, mask=mask, scale=1.0)
    assert torch.allclose(a, b, atol=_tol(q.dtype) * 10, rtol=1e-4)


@SETTINGS
@given(problems(min_lk=1))
def test_each_query_row_is_independent_of_the_others(prob):
    q, k, v, mask = prob
    if q.shape[2] == 0 or (mask is not None and not isinstance(mask, torch.Tensor)):
        return  # positional mask_mods depend on the row's index: covered by the grid tests
    out = qkv.attention(q, k, v, mask=mask)
    i = q.shape[2] // 2
    row_mask = None if mask is None else mask[:, :, i : i + 1]
    out_i = qkv.attention(q[:, :, i : i + 1], k, v, mask=row_mask)
    assert torch.allclose(out[:, :, i : i + 1], out_i, atol=_tol(q.dtype), rtol=0)

"""The oracle itself: against hand-computed cases and an independent position-by-position
float64 implementation (Python floats and math.exp, no tensor ops), plus the contract's edge
cases (fully masked rows, huge logits, dtypes, dropout)."""

from __future__ import annotations

import math

import pytest
import torch

import qkv


def test_hand_computed_tiny_case():
    q = torch.tensor([[1.0, 0.0]])  # [1, 2]
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # [2, 2]
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [2, 2]
    out, w = qkv.reference.attention(q, k, v, scale=1.0)
    # scores [1, 0] -> weights [e/(e+1), 1/(e+1)]
    a = math.e / (math.e + 1)
    assert w[0].tolist() == pytest.approx([a, 1 - a], abs=1e-7)
    assert out[0].tolist() == pytest.approx([a * 1 + (1 - a) * 3, a * 2 + (1 - a) * 4], abs=1e-6)


def test_default_scale_is_one_over_sqrt_head_dim():
    q = torch.ones(1, 4)
    k = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    _, w = qkv.reference.attention(q, k, torch.eye(2))
    # scores [4 / sqrt(4), 0] = [2, 0]
    assert w[0, 0].item() == pytest.approx(math.exp(2) / (math.exp(2) + 1), abs=1e-7)


def by_hand(q, k, v, scale, allowed, score_fn):
    """Attention one position at a time, in Python floats. ``q [Hq][Lq][D]`` lists etc."""
    Hq, Hkv = len(q), len(k)
    g = Hq // Hkv
    out, lses = [], []
    for h in range(Hq):
        kv = h // g
        rows, row_lse = [], []
        for i in range(len(q[h])):
            scores = {}
            for j in range(len(k[kv])):
                s = sum(a * b for a, b in zip(q[h][i], k[kv][j], strict=True)) * scale
                s = score_fn(s, h, i, j)
                if allowed(h, i, j):
                    scores[j] = s
            if not scores:
                rows.append([0.0] * len(v[kv][0]))
                row_lse.append(-math.inf)
                continue
            m = max(scores.values())
            z = sum(math.exp(s - m) for s in scores.values())
            rows.append(
                [
                    sum(math.exp(scores[j] - m) / z * v[kv][j][d] for j in scores)
                    for d in range(len(v[kv][0]))
                ]
            )
            row_lse.append(m + math.log(z))
        out.append(rows)
        lses.append(row_lse)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lses, dtype=torch.float64)


@pytest.mark.parametrize(
    "mask,allowed",
    [
        (None, lambda h, i, j: True),
        (qkv.causal, lambda h, i, j: j <= i),
        (qkv.sliding_window(1, 1), lambda h, i, j: abs(i - j) <= 1),
        (lambda b, h, q, k: (k <= q + h) & (q != 2), lambda h, i, j: j <= i + h and i != 2),
    ],
)
@pytest.mark.parametrize(
    "score_mod,score_fn",
    [
        (None, lambda s, h, i, j: s),
        (qkv.alibi(torch.tensor([0.5, 0.25, 1.0, 2.0])), None),
        (qkv.softcap(1.5), lambda s, h, i, j: 1.5 * math.tanh(s / 1.5)),
    ],
)
def test_oracle_equals_position_by_position_formula(mask, allowed, score_mod, score_fn):
    if score_fn is None:  # alibi
        slopes = [0.5, 0.25, 1.0, 2.0]

        def score_fn(s, h, i, j):
            return s + slopes[h] * (j - i)

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 5, 3, generator=gen, dtype=torch.float64)  # [Hq, Lq, D]
    k = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64)  # [Hkv, Lk, D]: GQA groups of 2
    v = torch.randn(2, 6, 2, generator=gen, dtype=torch.float64)  # [Hkv, Lk, Dv]
    expected, expected_lse = by_hand(q.tolist(), k.tolist(), v.tolist(), 0.7, allowed, score_fn)
    out, w = qkv.reference.attention(q, k, v, mask=mask, score_mod=score_mod, scale=0.7)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    _, lse = qkv.attention(
        q, k, v, mask=mask, score_mod=score_mod, scale=0.7, return_lse=True, backend="reference"
    )
    finite = torch.isfinite(expected_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite].double(), expected_lse[finite], atol=1e-5)
    # weights are a distribution over the allowed keys, 0 elsewhere
    for h in range(4):
        for i in range(5):
            row_allowed = [allowed(h, i, j) for j in range(6)]
            assert w[h, i].sum().item() == pytest.approx(1.0 if any(row_allowed) else 0.0)
            assert all(w[h, i, j] == 0 for j in range(6) if not row_allowed[j])


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_grads():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 5, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, 5, 8, generator=gen, requires_grad=True)
    bias = torch.randn(1, 2, 4, 5, generator=gen, requires_grad=True)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    for backend in ("reference", "auto"):
        out, lse = qkv.attention(
            q, k, v, mask=mask, score_mod=bias, return_lse=True, backend=backend
        )
        assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
        assert torch.isneginf(lse[:, :, 1]).all() and torch.isfinite(lse[:, :, [0, 2, 3]]).all()
        do = torch.randn(out.shape, generator=gen)
        gq, gk, gv, gb = torch.autograd.grad(out, (q, k, v, bias), do)
        for g in (gq, gk, gv, gb):
            assert torch.isfinite(g).all()
        assert torch.equal(gq[:, :, 1], torch.zeros_like(gq[:, :, 1]))
        assert torch.equal(gb[:, :, 1], torch.zeros_like(gb[:, :, 1]))


def test_no_keys_at_all():
    q = torch.randn(2, 3, 4, requires_grad=True)
    k = torch.randn(2, 0, 4)
    v = torch.randn(2, 0, 5)
    out, lse = qkv.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 3, 5) and torch.equal(out, torch.zeros(2, 3, 5))
    assert torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_empty_query_gives_empty_output():
    q, k, v = torch.randn(2, 4, 0, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 3)
    for backend in ("auto", "sdpa", "reference"):
        out = qkv.attention(q, k, v, mask=qkv.causal, backend=backend)
        assert out.shape == (2, 4, 0, 3)
    out, lse = qkv.attention(q, k, v, return_lse=True)
    assert lse.shape == (2, 4, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_huge_logits_never_overflow(dtype, backend):
    q = torch.tensor([[100.0, 0.0], [-100.0, 0.0]], dtype=dtype)  # scores up to 1e4
    k = torch.tensor([[100.0, 0.0], [-100.0, 0.0], [0.0, 0.0]], dtype=dtype)
    v = torch.tensor([[1.0], [2.0], [3.0]], dtype=dtype)
    out, lse = qkv.attention(q, k, v, scale=1.0, return_lse=True, backend=backend)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert out[:, 0].tolist() == [1.0, 2.0]  # each query picks its aligned key (score 1e4)
    assert lse.tolist() == pytest.approx([1e4, 1e4], rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_accumulate_in_float32(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=gen).to(dtype) for _ in range(3))
    out, lse = qkv.attention(q, k, v, return_lse=True, backend="reference")
    _, w = qkv.reference.attention(q, k, v)
    assert out.dtype == dtype and lse.dtype == torch.float32 and w.dtype == torch.float32
    exact, _ = qkv.reference.attention(q.double(), k.double(), v.double())
    # float32 accumulation leaves only the final rounding to the half dtype
    ulp = torch.finfo(dtype).eps
    assert (out.double() - exact).abs().max() <= ulp * exact.abs().max()


def test_unbatched_shapes_round_trip():
    gen = torch.Generator().manual_seed(0)
    q4 = torch.randn(1, 3, 5, 4, generator=gen)
    k4 = torch.randn(1, 3, 7, 4, generator=gen)
    v4 = torch.randn(1, 3, 7, 2, generator=gen)
    out4, w4 = qkv.reference.attention(q4, k4, v4)
    out3, w3 = qkv.reference.attention(q4[0], k4[0], v4[0])
    out2, w2 = qkv.reference.attention(q4[0, 1], k4[0, 1], v4[0, 1])
    assert out3.shape == (3, 5, 2) and w3.shape == (3, 5, 7)
    assert out2.shape == (5, 2) and w2.shape == (5, 7)
    assert torch.equal(out3, out4[0]) and torch.equal(w2, w4[0, 1])
    fast2, lse2 = qkv.attention(q4[0, 1], k4[0, 1], v4[0, 1], return_lse=True)
    assert fast2.shape == (5, 2) and lse2.shape == (5,)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "auto"])
def test_dropout_acts_on_probabilities_and_rescales(backend):
    # With v = identity, out is exactly the (dropped-out) probability matrix.
    torch.manual_seed(0)
    B, H, L = 2, 4, 64
    p = 0.3
    q, k = torch.randn(B, H, L, 16), torch.randn(B, H, L, 16)
    v = torch.eye(L).expand(B, H, L, L).contiguous()
    _, w = qkv.reference.attention(q, k, v, mask=qkv.causal)
    dropped = qkv.attention(q, k, v, mask=qkv.causal, dropout_p=p, backend=backend)
    visible = w > 0
    assert torch.equal(dropped[~visible], torch.zeros_like(dropped[~visible]))  # masked stay 0
    kept = dropped[visible] != 0
    frac_dropped = 1 - kept.float().mean().item()
    n = int(visible.sum())
    assert abs(frac_dropped - p) < 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    assert torch.allclose(dropped[visible][kept], w[visible][kept] / (1 - p), rtol=1e-4, atol=1e-7)
    # off by default
    assert torch.equal(
        qkv.attention(q, k, v, backend=backend), qkv.attention(q, k, v, backend=backend)
    )


@pytest.mark.parametrize(
    "mask",
    [
        "bool",
        "mod",
        qkv.and_masks(qkv.causal, qkv.document(torch.arange(13) // 5)),
        qkv.sliding_window(2),
    ],
    ids=["bool-tensor", "mask-mod", "causal-documents", "window"],
)
def test_rows_of_the_formula_are_its_rows(mask):
    """``forward(p, rows=...)`` (the plain formula in chunks, as torch.compile runs it past the
    dense limit) gives the rows of the whole: masks, a broadcast bias and a mod are taken at
    those rows, GQA included, a fully masked row too. Equal to float32 rounding (a matmul of
    fewer rows may block its sums differently); the masked weights are exactly 0 in both."""
    from qkv._door import validate

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 13, 7, generator=gen)
    k, v = torch.randn(2, 2, 11, 7, generator=gen), torch.randn(2, 2, 11, 5, generator=gen)
    if mask == "bool":
        mask = torch.rand(1, 4, 13, 11, generator=gen) > 0.3
        mask[..., 6, :] = False
    elif mask == "mod":

        def mask(b, h, qi, ki):
            return (qi + ki + h) % 3 != 0

    bias = torch.randn(1, 4, 13, 1, generator=gen)  # broadcast over batch and keys
    p = validate(q, k, v, mask=mask, score_mod=bias)
    out, lse, w = qkv.reference.forward(p, dropout_p=0.0)
    for r0, r1 in ((0, 5), (5, 6), (6, 13)):
        o, l, wr = qkv.reference.forward(p, dropout_p=0.0, rows=(r0, r1))
        torch.testing.assert_close(o, out[:, :, r0:r1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(l, lse[:, :, r0:r1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(wr, w[:, :, r0:r1], rtol=1e-6, atol=1e-6)
        assert torch.equal(wr == 0, w[:, :, r0:r1] == 0)

"""The built-in masks and score mods: the grids their docstrings draw, element-wise formulas,
and construction errors."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from catalogue import index_tensors


def grid(mod, Lq, Lk, B=1, H=1):
    b, h, qi, ki = index_tensors(B, H, Lq, Lk)
    return mod(b, h, qi, ki).expand(B, H, Lq, Lk).int()


def rows(*lines):
    return torch.tensor([[int(c) for c in line.split()] for line in lines])


def brute(pred, Lq, Lk):
    return torch.tensor([[int(bool(pred(i, j))) for j in range(Lk)] for i in range(Lq)])


def test_causal_grid_is_top_left_aligned():
    assert torch.equal(grid(qkv.causal, 3, 5)[0, 0], rows("1 0 0 0 0", "1 1 0 0 0", "1 1 1 0 0"))
    # the same as SDPA's is_causal for a non-square problem
    sdpa = torch.ones(3, 5, dtype=torch.bool).tril()
    assert torch.equal(grid(qkv.causal, 3, 5)[0, 0].bool(), sdpa)


def test_sliding_window_grid():
    expected = rows("1 0 0 0 0", "1 1 0 0 0", "1 1 1 0 0", "0 1 1 1 0", "0 0 1 1 1")
    assert torch.equal(grid(qkv.sliding_window(2), 5, 5)[0, 0], expected)


@pytest.mark.parametrize("left,right", [(0, 0), (1, 1), (3, 0), (0, 2), (10, 10)])
def test_sliding_window_formula(left, right):
    g = grid(qkv.sliding_window(left, right), 9, 11)[0, 0]
    assert torch.equal(g, brute(lambda i, j: i - left <= j <= i + right, 9, 11))


def test_prefix_lm_grid():
    expected = rows("1 1 0 0", "1 1 0 0", "1 1 1 0", "1 1 1 1")
    assert torch.equal(grid(qkv.prefix_lm(2), 4, 4)[0, 0], expected)


def test_document_grid():
    ids = torch.tensor([0, 0, 1, 1, 1])
    expected = rows("1 1 0 0 0", "1 1 0 0 0", "0 0 1 1 1", "0 0 1 1 1", "0 0 1 1 1")
    assert torch.equal(grid(qkv.document(ids), 5, 5)[0, 0], expected)


def test_padding_is_per_batch():
    g = grid(qkv.padding(torch.tensor([3, 5, 0])), 2, 5, B=3)
    assert torch.equal(g[0, 0], rows("1 1 1 0 0", "1 1 1 0 0"))
    assert torch.equal(g[1, 0], rows("1 1 1 1 1", "1 1 1 1 1"))
    assert g[2].sum() == 0


def test_and_or_masks():
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    m = qkv.and_masks(qkv.causal, qkv.document(ids))
    assert torch.equal(grid(m, 6, 6)[0, 0], brute(lambda i, j: j <= i and ids[i] == ids[j], 6, 6))
    o = qkv.or_masks(qkv.sliding_window(1), lambda b, h, q, k: k == 0)
    assert torch.equal(grid(o, 6, 6)[0, 0], brute(lambda i, j: i - 1 <= j <= i or j == 0, 6, 6))
    assert repr(m) == "qkv.and_masks(qkv.causal, qkv.document(<6 ids>))"


def test_combinators_check_their_arguments():
    with pytest.raises(ValueError, match="needs at least one mask_mod"):
        qkv.and_masks()
    with pytest.raises(TypeError, match=r"or_masks argument 1 is a Tensor.*lambda"):
        qkv.or_masks(qkv.causal, torch.ones(2, 2, dtype=torch.bool))
    # a combined user mask_mod that returns ints is caught with its name
    with pytest.raises(TypeError, match=r"mask_mod bad returned a torch.int64"):

        def bad(b, h, q, k):
            return q - k

        grid(qkv.and_masks(qkv.causal, bad), 2, 2)


@pytest.mark.parametrize(
    "make,err,match",
    [
        (lambda: qkv.sliding_window(-1), ValueError, r"left must be >= 0, got -1"),
        (lambda: qkv.sliding_window(2, -3), ValueError, r"right must be >= 0, got -3"),
        (lambda: qkv.sliding_window(2.5), TypeError, r"left must be an int, got float"),
        (lambda: qkv.prefix_lm(-2), ValueError, r"prefix_lm length must be >= 0, got -2"),
        (lambda: qkv.padding([1, 2]), TypeError, r"padding lengths must be a 1-D integer"),
        (lambda: qkv.padding(torch.tensor([1.0])), ValueError, r"dtype torch.float32"),
        (lambda: qkv.padding(torch.tensor([2, -1])), ValueError, r"got \[2, -1\]"),
        (
            lambda: qkv.document(torch.zeros(2, 3, 4, dtype=torch.long)),
            ValueError,
            r"\[L\].*or \[B, L\].*got shape \(2, 3, 4\).*ids.reshape\(-1, ids.shape\[-1\]\)",
        ),
        (lambda: qkv.document(torch.zeros(2, 3)), ValueError, r"dtype torch.float32"),
        (lambda: qkv.document([0, 1]), TypeError, r"integer tensor \[L\] or \[B, L\], got list"),
        (lambda: qkv.alibi(torch.ones(2, 2)), ValueError, r"shape \(2, 2\)"),
        (lambda: qkv.alibi([0.5]), TypeError, r"alibi slopes must be a 1-D float tensor"),
        (lambda: qkv.softcap(0), ValueError, r"positive finite number, got 0"),
        (lambda: qkv.softcap(-3.0), ValueError, r"got -3.0"),
        (lambda: qkv.relative_bias(torch.zeros(4, 2), 2), ValueError, r"has 4 rows.*needs"),
        (lambda: qkv.relative_bias(torch.zeros(5, 2), -1), ValueError, r"got -1"),
        (lambda: qkv.alibi_slopes(0), ValueError, r"positive number of heads, got 0"),
    ],
)
def test_construction_errors(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_padding_reads_lengths_once_until_they_are_edited(monkeypatch):
    """A padding mask made in every forward from the same lengths checks their values once
    (a read costs a few us beside a small call); an in-place edit is checked again."""
    reads = []
    real_min = torch.Tensor.min

    def counted(self, *args, **kw):
        reads.append(1)
        return real_min(self, *args, **kw)

    lengths = torch.tensor([3, 1])
    monkeypatch.setattr(torch.Tensor, "min", counted)
    for _ in range(3):
        qkv.padding(lengths)
    assert len(reads) == 1
    lengths[1] = -2
    with pytest.raises(ValueError, match=r"got \[3, -2\]"):
        qkv.padding(lengths)
    with pytest.raises(ValueError, match=r"got \[3, -2\]"):  # and not kept as checked
        qkv.padding(lengths)


def scores_after(mod, Lq=4, Lk=6, H=2):
    b, h, qi, ki = index_tensors(1, H, Lq, Lk)
    s = torch.randn(1, H, Lq, Lk, generator=torch.Generator().manual_seed(0))
    return s, mod(s, b, h, qi, ki)


def test_alibi_formula():
    slopes = torch.tensor([0.5, 0.25])
    s, out = scores_after(qkv.alibi(slopes))
    for h in range(2):
        for i in range(4):
            for j in range(6):
                assert out[0, h, i, j] == pytest.approx(float(s[0, h, i, j] + slopes[h] * (j - i)))


def test_alibi_slopes_match_the_paper():
    # 8 heads: 1/2, 1/4, ..., 1/256 (Press et al., 2022)
    assert torch.allclose(qkv.alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))
    s12 = qkv.alibi_slopes(12)
    assert s12.shape == (12,) and torch.all(s12 > 0) and len(set(s12.tolist())) == 12


def test_softcap_formula_and_bound():
    s, out = scores_after(qkv.softcap(2.0))
    assert torch.allclose(out, 2.0 * torch.tanh(s / 2.0))
    big = torch.tensor([1e4, -1e4])
    capped = qkv.softcap(30.0)(big, *index_tensors(1, 1, 1, 2))
    assert capped.abs().max() <= 30.0


def test_relative_bias_formula_and_clamping():
    R, H = 2, 2
    table = torch.arange((2 * R + 1) * H, dtype=torch.float32).view(2 * R + 1, H)
    s, out = scores_after(qkv.relative_bias(table, R), Lq=5, Lk=7, H=H)
    for h in range(H):
        for i in range(5):
            for j in range(7):
                d = max(-R, min(R, i - j))
                assert out[0, h, i, j] == pytest.approx(float(s[0, h, i, j] + table[d + R, h]))


def test_builtins_work_in_attention_and_are_printable():
    q = torch.randn(1, 2, 5, 4)
    for m in [qkv.causal, qkv.sliding_window(1, 2), qkv.prefix_lm(1)]:
        out = qkv.attention(q, q, q, mask=m)
        assert isinstance(out, torch.Tensor) and torch.isfinite(out).all()
        assert repr(m).startswith("qkv.")
    for s in [qkv.alibi(qkv.alibi_slopes(2)), qkv.softcap(5.0)]:
        assert repr(s).startswith("qkv.")
        assert math.isfinite(float(qkv.attention(q, q, q, score_mod=s).sum()))


def test_a_padding_mask_pickles_and_keeps_its_name():
    """Its name is made from its tensors when first shown (nothing made inside a compiled
    function reads them), and the mask pickles like every built-in."""
    import pickle

    for m in (
        qkv.padding(torch.tensor([3, 5])),
        qkv.padding(torch.tensor([3, 5]), start=torch.tensor([2, 0])),
    ):
        back = pickle.loads(pickle.dumps(m))
        assert repr(back) == repr(m)
        b, h, qi, ki = index_tensors(2, 1, 4, 5)
        assert torch.equal(back(b, h, qi, ki), m(b, h, qi, ki))
    assert repr(qkv.padding(torch.tensor([3, 5]), start=torch.tensor([2, 0]))) == (
        "qkv.padding([3, 5], start=[2, 0])"
    )

"""Dropout in the block-sparse backend: it acts on the probabilities, rescales by 1/(1-p),
never revives a masked position, has the right statistics, and the backward applies exactly
the forward's pattern."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import qkv
from catalogue import Shape, index_tensors, make_score

blocksparse = functools.partial(qkv.attention, backend="blocksparse")


def _dropout_probe(seed: int, p: float, mask: Any):
    """With v = identity the output rows ARE the dropped, rescaled probabilities."""
    L = 48
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, L, 8, generator=gen)
    k = torch.randn(1, 2, L, 8, generator=gen)
    eye = torch.eye(L).expand(1, 2, L, L)
    torch.manual_seed(seed)
    dropped = blocksparse(q, k, eye, mask=mask, dropout_p=p)
    _, weights = qkv.reference.attention(q, k, eye, mask=mask)
    return dropped, weights, q, k


def test_dropout_statistics_and_masked_zeros():
    p = 0.3
    mask = qkv.block_mask(qkv.sliding_window(10), None, None, 48, 48, block_size=8)
    dropped, weights, _, _ = _dropout_probe(0, p, mask)
    kept = dropped != 0
    visible = weights > 0
    assert not bool(kept[~visible].any()), "a masked position survived dropout"
    torch.testing.assert_close(dropped[kept], weights[kept] / (1 - p))
    frac = float(kept[visible].float().mean())
    n = int(visible.sum())
    assert abs(frac - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5, frac
    # Over many seeds the expectation is the undropped attention: each entry is w/(1-p) with
    # probability 1-p, else 0, so its mean over n seeds has std w*sqrt(p/(1-p)/n).
    n_seeds = 40
    mean = sum(_dropout_probe(s, p, mask)[0] for s in range(n_seeds)) / n_seeds
    std = weights * (p / (1 - p) / n_seeds) ** 0.5
    assert bool(((mean - weights).abs() <= 5 * std + 1e-6).all())
    # The mean absolute deviation of such a mean is about 0.8 std; far more means a bias.
    assert float((mean - weights).abs().sum()) < 1.0 * float(std.sum())
    # The same seed gives the same pattern; another seed a different one.
    assert torch.equal(_dropout_probe(0, p, mask)[0], dropped)
    assert not torch.equal(_dropout_probe(1, p, mask)[0], dropped)


@pytest.mark.parametrize("score", ["none", "relative"])
def test_dropout_backward_uses_the_forward_pattern(score):
    """Recover the keep-pattern with v = identity, then check out and every gradient against
    a dense computation that applies exactly that pattern."""
    p, L = 0.25, 48
    mask = qkv.block_mask(qkv.causal, None, None, L, L, block_size=16)
    dropped, weights, q, k = _dropout_probe(11, p, mask)
    keep = (dropped != 0) | (weights == 0)
    sm, params = make_score(score, Shape(1, 2, 2, L, L, 8), 1)
    v = torch.randn(1, 2, L, 8)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    torch.manual_seed(11)
    out = blocksparse(qf, kf, vf, mask=mask, score_mod=sm, dropout_p=p)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, [qf, kf, vf, *params], do)

    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    s = (qd @ kd.transpose(-2, -1)) / 8**0.5
    if sm is not None:
        s = sm(s, *index_tensors(1, 2, L, L))
    s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    w = torch.softmax(s, -1) * keep / (1 - p)
    ref = w @ vd
    want = torch.autograd.grad(ref, [qd, kd, vd, *params], do.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b_.double(), rtol=1e-4, atol=1e-4)

"""The block-sparse backward: gradients reach every tensor a score_mod closes over (tables,
module parameters, globals, partials, non-leaves, nested closures, hidden dependencies via
checkpointing), a score_mod sees only real scores, the lse's gradient folds in, and double
backward is refused rather than wrong."""

from __future__ import annotations

import functools

import pytest
import torch

import qkv
from catalogue import SHAPES, make_qkv
from qkv.backends.blocksparse import autograd  # private: its closure search is tested

blocksparse = functools.partial(qkv.attention, backend="blocksparse")
with_lse = functools.partial(qkv.attention, backend="blocksparse", return_lse=True)

TILES = SHAPES["tiles"]  # [2, 4|2, 70|90, 24|16]


def test_gradients_reach_captured_tables(check):
    q, k, v = make_qkv(TILES)
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(9, 4, generator=gen).requires_grad_()
    slopes = torch.rand(4, generator=gen).requires_grad_()
    rel, ali = qkv.relative_bias(table, 4), qkv.alibi(slopes)
    both = lambda s, b, h, i, j: rel(ali(s, b, h, i, j), b, h, i, j)  # noqa: E731
    m = qkv.block_mask(qkv.causal, 2, 4, 70, 90, block_size=16)
    check(with_lse, q, k, v, mask=m, score_mod=both, extra_params=(table, slopes))


class _ModuleBias(torch.nn.Module):
    def __init__(self, H: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(H) * 0.3)

    def forward(self, s, b, h, q, k):
        return s + self.w[h] * (q - k).float().abs().sqrt()


_GLOBAL_TABLE = torch.randn(4, requires_grad=True)


def _uses_global(s, b, h, q, k):
    return s - _GLOBAL_TABLE[h] * ((q + k) % 2).float()


def test_gradients_reach_modules_globals_partials_and_non_leaves(check):
    q, k, v = make_qkv(TILES)
    m = qkv.block_mask(qkv.sliding_window(20), 2, 4, 70, 90, block_size=16)
    mod = _ModuleBias(4)
    check(with_lse, q, k, v, mask=m, score_mod=mod, extra_params=(mod.w,))
    check(with_lse, q, k, v, mask=m, score_mod=_uses_global, extra_params=(_GLOBAL_TABLE,))
    # A non-leaf captured tensor: the gradient must flow on through it to `base`.
    base = torch.randn(4, requires_grad=True)
    grads = []
    for backend, dtype in (("blocksparse", torch.float32), ("reference", torch.float64)):
        b64 = base.detach().to(dtype).requires_grad_()
        scaled = b64 * 2  # [H], built fresh for each graph
        part = functools.partial(lambda s, b, h, q, k, t: s + t[h], t=scaled)
        out = qkv.attention(
            *(t.to(dtype) for t in (q, k, v)), mask=m, score_mod=part, backend=backend
        )
        grads.append(torch.autograd.grad(out.double().square().sum(), b64)[0])
    torch.testing.assert_close(grads[0].double(), grads[1], rtol=1e-4, atol=1e-4)


def test_nested_closures_are_searched(check):
    q, k, v = make_qkv(TILES)
    hidden = torch.randn(4, requires_grad=True)
    holder = {"t": hidden}

    def helper(h):
        return holder["t"][h]

    def opaque(s, b, h, i, j):  # its own cells hold only `helper`
        return s + helper(h)

    # private: the engine's closure search is the unit tested (found, so no checkpointing)
    assert autograd.captured(opaque) == [hidden]
    check(with_lse, q, k, v, mask=qkv.causal, score_mod=opaque, extra_params=(hidden,))


def test_hidden_dependency_falls_back_to_checkpointing(check, monkeypatch):
    """A tensor held by a class attribute is not searched; the first score_mod call notices
    the dependency and the engine differentiates per block with checkpointing instead."""
    q, k, v = make_qkv(TILES)
    hidden = torch.randn(4, requires_grad=True)

    class Holder:
        table = hidden

    def deeper(s, b, h, i, j):
        return s + Holder.table[h]

    # private: which of the engine's two gradient routes runs is the unit tested
    assert autograd.captured(deeper) == []
    used = []
    real = autograd.checkpointed
    monkeypatch.setattr(autograd, "checkpointed", lambda *a: used.append(1) or real(*a))
    m = qkv.block_mask(qkv.sliding_window(20), 2, 4, 70, 90, block_size=16)
    check(with_lse, q, k, v, mask=m, score_mod=deeper, extra_params=(hidden,))
    assert used


def test_score_mod_sees_only_real_scores():
    """No probe calls: every score a score_mod sees is a real piece of q kᵀ * scale."""
    q, k, v = make_qkv(TILES, requires_grad=True)
    seen = []

    def spy(s, b, h, i, j):
        seen.append((s.detach().clone(), i.clone(), j.clone()))
        return s

    m = qkv.block_mask(qkv.causal, 2, 4, 70, 90, block_size=16)
    blocksparse(q, k, v, mask=m, score_mod=spy).sum().backward()
    kk = k.detach().repeat_interleave(2, 1)  # [B, Hq, Lk, D]
    full = (q.detach() @ kk.transpose(-2, -1)) / 24**0.5  # [B, Hq, Lq, Lk]
    for s, i, j in seen:
        want = full[:, :, i.view(-1)][..., j.view(-1)]
        torch.testing.assert_close(s, want)


def test_gradient_through_lse():
    """A loss that uses the lse: its gradient folds into D (fused and matmul kernels)."""
    q, k, v = make_qkv(TILES)
    w = torch.randn(2, 4, 70, generator=torch.Generator().manual_seed(7))
    masks = [None, qkv.causal, qkv.block_mask(qkv.sliding_window(9), 2, 4, 70, 90, block_size=16)]
    for sm in (None, qkv.softcap(5.0)):
        for mask in masks:
            grads = []
            for backend, dtype in (("blocksparse", torch.float32), ("reference", torch.float64)):
                x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
                out, lse = qkv.attention(
                    *x, mask=mask, score_mod=sm, return_lse=True, backend=backend
                )
                loss = out.double().square().sum() + (lse.double() * w).sum()
                grads.append(torch.autograd.grad(loss, x))
            for fast, ref in zip(*grads, strict=True):
                torch.testing.assert_close(fast.double(), ref, rtol=1e-4, atol=1e-4)


def test_double_backward_is_refused_not_wrong():
    q, k, v = make_qkv(TILES, requires_grad=True)
    out = blocksparse(q, k, v, mask=qkv.sliding_window(9))
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gq.sum().backward()

"""Block masks: analytic planning of the built-ins equals tile-by-tile evaluation, never
touches n² positions, and a BlockMask is validated, reusable and printable."""

from __future__ import annotations

import time

import pytest
import torch

import qkv
from catalogue import MASKS, Shape, index_tensors, make_mask
from qkv._core import grid, tiles  # private: evaluation hook, budget, limits are unit tested

Tensor = torch.Tensor

EMPTY, PARTIAL, FULL = 0, 1, 2  # the values of BlockMask.states, as its docstring defines them


def _evaluated(mod, B, H, Lq, Lk, bs) -> Tensor:
    """The tile states found by evaluating every position through the public contract (the
    mask_mod on the full index tensors, or the bool tensor itself), independently of qkv's
    planner: int8 ``[B|1, H|1, nq, nk]``, keeping the dims the mask does not vary over."""
    bq, bk = bs
    m = mod if isinstance(mod, Tensor) else mod(*index_tensors(B, H, Lq, Lk))
    while m.ndim < 4:
        m = m.unsqueeze(0)
    b, h = m.shape[:2]
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    # Positions past the ends neither show (seen) nor hide (full) anything.
    seen = torch.zeros(b, h, nq * bq, nk * bk, dtype=torch.bool)  # [b, h, nq*bq, nk*bk]
    full = torch.ones(b, h, nq * bq, nk * bk, dtype=torch.bool)  # [b, h, nq*bq, nk*bk]
    seen[:, :, :Lq, :Lk] = m
    full[:, :, :Lq, :Lk] = m
    tiles = (b, h, nq, bq, nk, bk)
    any_ = seen.view(tiles).any(5).any(3)  # [b, h, nq, nk]: some position visible
    all_ = full.view(tiles).all(5).all(3)  # [b, h, nq, nk]: every position visible
    return any_.to(torch.int8) + all_.to(torch.int8)  # 0 empty, 1 partial, 2 full


def _builtins(n: int) -> list:
    """The catalogue's built-in masks and and/or combinations (planned from structure), then
    the two combinations with an arbitrary mask_mod (evaluated in part)."""
    gen = torch.Generator().manual_seed(0)
    shape = Shape(3, 8, 8, n, n, 8)
    names = [m for m, e in MASKS.items() if e.analytic] + ["or_mod", "and_mod"]
    return [make_mask(m, shape, gen) for m in names]


N_ANALYTIC = sum(e.analytic for e in MASKS.values())


@pytest.mark.parametrize("Lq,Lk", [(1, 1), (7, 13), (113, 45), (64, 64), (200, 257), (257, 200)])
@pytest.mark.parametrize("bs", [(1, 1), (8, 8), (16, 7), (5, 32), (128, 128)])
def test_analytic_states_equal_evaluation(Lq, Lk, bs):
    """Built-in masks planned from their structure classify every tile exactly as evaluating
    every position would (block sizes that do not divide the lengths included)."""
    for mod in _builtins(max(Lq, Lk)):
        got = qkv.block_mask(mod, 3, 2, Lq, Lk, block_size=bs).states
        want = _evaluated(mod, 3, 2, Lq, Lk, bs)
        shape = torch.broadcast_shapes(got.shape, want.shape)
        assert torch.equal(got.expand(shape), want.expand(shape)), (mod, Lq, Lk, bs)


def test_builtins_never_evaluate_positions(monkeypatch):
    """The planner never evaluates a built-in mask position by position: evaluation is
    forbidden here, and n = 131072 (17 G positions) plans in well under a second."""

    def forbidden(mod, g):
        raise AssertionError(f"evaluated {mod!r} position by position")

    monkeypatch.setattr(tiles, "_evaluate", forbidden)  # private: the planner's evaluation hook
    n = 131072
    for mod in _builtins(n)[:N_ANALYTIC]:  # the rest hold an arbitrary mask_mod
        t = time.perf_counter()
        bm = qkv.block_mask(mod, 3, 8, n, n)
        took = time.perf_counter() - t
        assert bm.evaluated == []
        # Generous for a loaded 2-core machine; n² evaluation would take minutes.
        assert took < 5.0, f"{mod!r} took {took:.2f}s"


def test_builtins_at_a_million_positions():
    """n = 2**20 (10^12 positions) plans from structure alone; the mask_mod is never called."""
    calls = []

    class Counting(qkv._core.builtin_mods.Band):  # private: a built-in band that counts its calls
        def __call__(self, b, h, q_idx, kv_idx):
            calls.append(q_idx.numel() * kv_idx.numel())
            return super().__call__(b, h, q_idx, kv_idx)

    n = 1 << 20
    window = Counting(-256, 0, "counting window")
    t = time.perf_counter()
    bm = qkv.block_mask(window, None, None, n, n, block_size=1024)
    assert time.perf_counter() - t < 10.0
    assert calls == []
    counts = bm.num_blocks
    assert counts["full"] + counts["partial"] == 1024 + 1023  # the diagonal and one below
    assert counts["full"] == 0  # a 257-wide band cannot fill a 1024-wide tile


def test_arbitrary_mask_mod_is_evaluated_in_bounded_tiles(monkeypatch):
    """A mask_mod without structure is evaluated tile by tile, each call bounded."""
    monkeypatch.setattr(tiles, "EVAL_BUDGET", 4096)  # private: the evaluation budget is tested
    sizes = []

    def dilated(b, h, q_idx, kv_idx):
        sizes.append(b.shape[0] * h.shape[1] * q_idx.shape[-2] * kv_idx.shape[-1])
        return (q_idx - kv_idx) % 4 == 0

    bm = qkv.block_mask(dilated, 2, 2, 300, 260, block_size=16)
    assert max(sizes) <= 4096
    assert sum(sizes) == 2 * 2 * 300 * 260  # every position exactly once
    assert bm.evaluated == ["dilated"]
    want = _evaluated(dilated, 2, 2, 300, 260, (16, 16))
    assert torch.equal(bm.states, want.expand_as(bm.states))


def test_all_full_all_partial_all_empty():
    full = qkv.block_mask(lambda b, h, q, k: q >= 0, None, None, 100, 70, block_size=16)
    assert bool((full.states == FULL).all())
    checker = qkv.block_mask(
        lambda b, h, q, k: (q + k) % 2 == 0, None, None, 100, 70, block_size=16
    )
    assert bool((checker.states == PARTIAL).all())
    empty = qkv.block_mask(lambda b, h, q, k: q < 0, None, None, 100, 70, block_size=16)
    assert bool((empty.states == EMPTY).all())
    assert empty.block_density() == 0.0
    assert full.block_density() == 1.0


def test_bool_tensor_block_mask_and_dims():
    gen = torch.Generator().manual_seed(1)
    m = torch.rand(2, 1, 50, 40, generator=gen) > 0.9
    m[0] = False
    bm = qkv.block_mask(m, 2, 3, 50, 40, block_size=(16, 8))
    assert bm.states.shape == (2, 1, 4, 5)  # varies over batch, not heads
    assert bool((bm.states[0] == EMPTY).all())
    assert torch.equal(bm.states, _evaluated(m, 2, 3, 50, 40, (16, 8)))
    # As mask_mod (for dense backends) it reproduces the tensor.
    assert torch.equal(bm.mask_mod(*index_tensors(2, 3, 50, 40)), m.expand(2, 3, 50, 40))


def test_padding_varies_over_batch_only():
    bm = qkv.block_mask(qkv.padding(torch.tensor([5, 40])), 2, 4, 30, 40, block_size=8)
    assert bm.states.shape == (2, 1, 4, 5)
    assert bm.states[0, 0, :, 1:].eq(EMPTY).all() and bm.states[0, 0, :, 0].eq(PARTIAL).all()
    assert bm.states[1].eq(FULL).all()


def test_block_mask_validation_errors():
    bm = qkv.block_mask(qkv.causal, 1, 2, 64, 64)
    q = torch.randn(1, 2, 32, 8)
    with pytest.raises(ValueError, match=r"Lq=64, Lk=64.*qkv.block_mask"):
        qkv.attention(q, q, q, mask=bm)
    with pytest.raises(ValueError, match="batch 1"):
        qkv.attention(*(torch.randn(3, 2, 64, 8),) * 3, mask=bm)
    with pytest.raises(ValueError, match="2 heads"):
        qkv.attention(*(torch.randn(1, 4, 64, 8),) * 3, mask=bm)
    with pytest.raises(ValueError, match="block_size"):
        qkv.block_mask(qkv.causal, 1, 1, 8, 8, block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        qkv.block_mask(qkv.causal, 1, 1, 8, 8, block_size=(4, 4, 4))
    with pytest.raises(ValueError, match="Lq must be an int"):
        qkv.block_mask(qkv.causal, 1, 1, -1, 8)
    with pytest.raises(TypeError, match="bool tensor"):
        qkv.block_mask(torch.ones(8, 8), 1, 1, 8, 8)
    with pytest.raises(TypeError, match="mask_mod"):
        qkv.block_mask("causal", 1, 1, 8, 8)
    with pytest.raises(ValueError, match="does not broadcast"):
        qkv.block_mask(torch.ones(3, 8, dtype=torch.bool), 1, 1, 8, 8)
    with pytest.raises(ValueError, match="ids has 4 entries"):
        qkv.block_mask(qkv.document(torch.tensor([0, 0, 1, 1])), 1, 1, 8, 8)
    with pytest.raises(TypeError, match="returned"):
        qkv.block_mask(lambda b, h, q, k: (q - k).float(), 1, 1, 8, 8)


def test_broadcast_block_mask_serves_any_batch_and_heads():
    bm = qkv.block_mask(qkv.sliding_window(8), None, None, 64, 64, block_size=16)
    for B, H in ((1, 1), (3, 4)):
        x = torch.randn(B, H, 64, 8)
        out = qkv.attention(x, x, x, mask=bm, backend="blocksparse")
        ref, _ = qkv.reference.attention(x, x, x, mask=qkv.sliding_window(8))
        torch.testing.assert_close(out, ref)


def test_block_mask_matches_its_mask_on_dense_backends():
    x = torch.randn(2, 2, 40, 8)
    ids = torch.tensor([0] * 15 + [1] * 25)
    mod = qkv.and_masks(qkv.causal, qkv.document(ids))
    bm = qkv.block_mask(mod, 2, 2, 40, 40, block_size=16)
    want, _ = qkv.reference.attention(x, x, x, mask=mod)
    got, _ = qkv.reference.attention(x, x, x, mask=bm)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(qkv.attention(x, x, x, mask=bm, backend="sdpa"), want)


def test_repr_and_grid():
    bm = qkv.block_mask(qkv.sliding_window(256), None, None, 1024, 1024)
    text = bm.to_string()
    assert "qkv.sliding_window(256)" in text and "block 128x128" in text
    rows = text.splitlines()[1:]
    assert rows[0] == "+......." and rows[2] == "+#+....."
    # row 0: diagonal; row 1: one full + diagonal; rows 2-7: partial, full, diagonal
    assert bm.num_blocks == {"full": 7, "partial": 14, "empty": 43}


def test_unsorted_document_ids_are_exact_or_conservative(monkeypatch):
    ids = torch.tensor([0, 1] * 32)  # every tile holds both documents
    bm = qkv.block_mask(qkv.document(ids), None, None, 64, 64, block_size=8)
    assert bool((bm.states == PARTIAL).all())
    ids = torch.tensor([0] * 16 + [1] * 16 + [0] * 16 + [2] * 16)
    bm = qkv.block_mask(qkv.document(ids), None, None, 64, 64, block_size=16)
    assert torch.equal(bm.states, _evaluated(qkv.document(ids), 1, 1, 64, 64, (16, 16)))
    # Too many documents for the exact plan: every tile partial (correct, skips nothing).
    monkeypatch.setattr(grid, "_PRESENCE_CELLS", 1)  # private: the exact plan's limit
    bm = qkv.block_mask(qkv.document(ids), None, None, 64, 64, block_size=16)
    assert bool((bm.states == PARTIAL).all())

"""The test catalogue says the truth about its entries: a mask flagged ``analytic`` is planned
without evaluating a position (and no other is), ``tensor`` entries are tensors, exactly the
``dead_rows`` entries have query rows that see no key, and every factory is reproducible
from its seed."""

from __future__ import annotations

import pytest
import torch

import qkv
from catalogue import MASKS, SCORES, SHAPES, index_tensors, make_mask, make_qkv, make_score

Tensor = torch.Tensor

SHAPE = SHAPES["tiles"]  # B = 2, so padding has its keyless batch element


def _dense(mask: object) -> Tensor:
    """The mask over the whole ``[B, Hq, Lq, Lk]`` grid, by the README's contract."""
    s = SHAPE
    m = mask if isinstance(mask, Tensor) else mask(*index_tensors(s.B, s.Hq, s.Lq, s.Lk))  # type: ignore[operator]
    return m.expand(s.B, s.Hq, s.Lq, s.Lk)


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_entries_are_what_their_flags_say(name: str) -> None:
    entry = MASKS[name]
    mask = make_mask(name, SHAPE, 0)
    if mask is None:
        assert name == "none" and not (entry.analytic or entry.tensor or entry.dead_rows)
        return
    assert isinstance(mask, Tensor) == entry.tensor
    dense = _dense(mask)
    assert bool((~dense.any(-1)).any()) == entry.dead_rows, "rows that see no key"
    bm = qkv.block_mask(mask, SHAPE.B, SHAPE.Hq, SHAPE.Lq, SHAPE.Lk, block_size=16)
    assert (bm.evaluated == []) == entry.analytic, bm.evaluated
    assert torch.equal(_dense(make_mask(name, SHAPE, 0)), dense)  # the seed decides it all
    assert entry.doc


@pytest.mark.parametrize("name", list(SCORES))
def test_score_entries_apply_and_say_what_needs_a_gradient(name: str) -> None:
    entry = SCORES[name]
    s = SHAPE
    scores = torch.randn(s.B, s.Hq, s.Lq, s.Lk, generator=torch.Generator().manual_seed(1))
    results = []
    for grad in (True, False):
        score_mod, params = make_score(name, s, 0, grad=grad)
        assert isinstance(score_mod, Tensor) == entry.tensor
        assert all(p.is_leaf and p.requires_grad for p in params)
        assert grad or params == ()
        if score_mod is None:
            results.append(scores)
        elif isinstance(score_mod, Tensor):
            assert not score_mod.requires_grad  # compare_to_oracle differentiates it itself
            results.append(scores + score_mod)
        else:
            results.append(score_mod(scores, *index_tensors(s.B, s.Hq, s.Lq, s.Lk)))
    assert results[0].shape == scores.shape
    assert torch.equal(results[0].detach(), results[1])  # the same values with or without grad
    assert (name == "none") == (make_score(name, s)[0] is None)
    assert entry.doc


def test_qkv_factory_is_seeded_and_dtype_independent() -> None:
    shape = SHAPE.replace(D=59)  # Dv stays 16
    q, k, v = make_qkv(shape, gen=3)
    assert (q.shape, k.shape, v.shape) == ((2, 4, 70, 59), (2, 2, 90, 59), (2, 2, 90, 16))
    qb, kb, vb = make_qkv(shape, gen=torch.Generator().manual_seed(3), dtype=torch.bfloat16)
    assert qb.dtype == torch.bfloat16 and torch.equal(qb, q.bfloat16())
    assert torch.equal(kb, k.bfloat16()) and torch.equal(vb, v.bfloat16())
    qg, _, _ = make_qkv(shape, gen=3, requires_grad=True)
    assert qg.is_leaf and qg.requires_grad and torch.equal(qg.detach(), q)
    assert not torch.equal(make_qkv(shape, gen=4)[0], q)

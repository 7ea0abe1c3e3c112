"""The same mask_mods and score_mods give the same numbers in qkv and in PyTorch's
FlexAttention (run eagerly on the CPU, forward only: it has no CPU backward)."""

from __future__ import annotations

import warnings

import pytest
import torch

import qkv
from catalogue import MASKS, SHAPES, make_mask, make_qkv, make_score

flex = pytest.importorskip("torch.nn.attention.flex_attention")

SHAPE = SHAPES["flex"]  # [2, 4|2, 40|56, 16]


def flex_run(q, k, v, mask_mod, score_mod):
    block_mask = None
    if mask_mod is not None:
        s = SHAPE
        block_mask = flex.create_block_mask(mask_mod, s.B, s.Hq, s.Lq, s.Lk, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        return flex.flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_lse=True
        )


# Every mask the catalogue has as a callable (FlexAttention takes no bool tensors): the
# built-ins, their and/or combinations, arbitrary and head-dependent mask_mods, fully masked
# rows. Every score_mod but the bias tensors.
FLEX_MASKS = [m for m, e in MASKS.items() if not e.tensor and m != "none"]
FLEX_SCORES = ["none", "alibi", "softcap", "relative", "closure"]

# every mask alone, and every score mod with a few masks (the full cross adds little)
CASES = [(m, "none") for m in FLEX_MASKS] + [
    (m, s) for s in FLEX_SCORES if s != "none" for m in ("causal", "document", "head_dependent")
]


@pytest.mark.parametrize("mask_name,score_name", CASES)
def test_same_numbers_as_flex_attention(mask_name, score_name):
    gen = torch.Generator().manual_seed(2)
    q, k, v = make_qkv(SHAPE, gen=gen)
    mask = make_mask(mask_name, SHAPE, gen)
    score = make_score(score_name, SHAPE, gen, grad=False)[0]
    want, want_lse = flex_run(q, k, v, mask, score)
    got, lse = qkv.attention(q, k, v, mask=mask, score_mod=score, return_lse=True)
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite], want_lse[finite], atol=2e-5)

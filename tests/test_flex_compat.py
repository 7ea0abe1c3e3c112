"""The same mask_mods and score_mods give the same numbers in qkv and in PyTorch's
FlexAttention (run eagerly on the CPU, forward only: it has no CPU backward)."""

from __future__ import annotations

import warnings

import pytest
import torch

import qkv

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, HQ, HKV, LQ, LK, D = 2, 4, 2, 40, 56, 16


def flex_run(q, k, v, mask_mod, score_mod):
    block_mask = None
    if mask_mod is not None:
        block_mask = flex.create_block_mask(mask_mod, B, HQ, LQ, LK, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        return flex.flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_lse=True
        )


def _ids():
    return torch.sort(
        torch.randint(0, 5, (max(LQ, LK),), generator=torch.Generator().manual_seed(0))
    ).values


MASKS = {
    "causal": lambda: qkv.causal,
    "sliding_window": lambda: qkv.sliding_window(6, 2),
    "document": lambda: qkv.document(_ids()),
    "padding": lambda: qkv.padding(torch.tensor([17, 56])),
    "prefix_lm": lambda: qkv.prefix_lm(9),
    "and_masks": lambda: qkv.and_masks(qkv.causal, qkv.document(_ids())),
    "or_masks": lambda: qkv.or_masks(qkv.sliding_window(3), lambda b, h, q, k: k < 4),
    "user_dilated": lambda: lambda b, h, q, k: (q - k) % 4 == 0,
    "user_head": lambda: lambda b, h, q, k: k <= q + 3 * h,
}
SCORES = {
    "none": lambda: None,
    "alibi": lambda: qkv.alibi(qkv.alibi_slopes(HQ)),
    "softcap": lambda: qkv.softcap(3.0),
    "relative_bias": lambda: qkv.relative_bias(
        torch.randn(2 * 5 + 1, HQ, generator=torch.Generator().manual_seed(1)), 5
    ),
    "user_closure": lambda: lambda s, b, h, q, k: s + 0.01 * (q - k) * (h + 1),
}


# every mask alone, and every score mod with a few masks (the full cross adds little)
CASES = [(m, "none") for m in MASKS] + [
    (m, s) for s in SCORES if s != "none" for m in ("causal", "document", "user_head")
]


@pytest.mark.parametrize("mask_name,score_name", CASES)
def test_same_numbers_as_flex_attention(mask_name, score_name):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, HQ, LQ, D, generator=gen)
    k = torch.randn(B, HKV, LK, D, generator=gen)
    v = torch.randn(B, HKV, LK, D, generator=gen)
    mask, score = MASKS[mask_name](), SCORES[score_name]()
    want, want_lse = flex_run(q, k, v, mask, score)
    got, lse = qkv.attention(q, k, v, mask=mask, score_mod=score, return_lse=True)
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite], want_lse[finite], atol=2e-5)

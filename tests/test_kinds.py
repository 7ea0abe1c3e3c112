"""Classification at the door (qkv._core.kinds): every mask and score becomes one value of its
class with the terms kernels read, and combinations of built-ins are simplified to the mask they
are — without changing a single position they allow."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv._core.builtin_mods import Document, KvBelow, Prefix
from qkv._core.combinations import And, Or
from qkv._core.evaluate import grid
from qkv._core.kinds import MaskKind, band, classify_mask, classify_score  # the unit under test
from qkv._positions import mask_at  # the KV-cache shift, tested on purpose

L = 40


def _grid(mod: object) -> torch.Tensor:
    b, h, qi, ki = grid((0, 2), (0, 3), (0, L), (0, L + 5), torch.device("cpu"))
    return mod(b, h, qi, ki).expand(2, 3, L, L + 5)  # type: ignore[operator]


def _ids() -> torch.Tensor:
    return torch.arange(L + 5) // 9


CASES = [
    # (mask, expected kind, expected band (lo, hi) or None)
    (None, "none", None),
    (qkv.causal, "causal", (None, 0)),
    (qkv.sliding_window(5), "band", (-5, 0)),
    (qkv.and_masks(qkv.causal, qkv.sliding_window(5)), "band", (-5, 0)),
    (qkv.and_masks(qkv.sliding_window(5), qkv.causal), "band", (-5, 0)),
    (qkv.and_masks(qkv.sliding_window(8), qkv.sliding_window(3, 2)), "band", (-3, 0)),
    (qkv.and_masks(qkv.sliding_window(2, 6), qkv.sliding_window(9, 1)), "band", (-2, 1)),
    (qkv.or_masks(qkv.sliding_window(4), qkv.sliding_window(9, 0)), "band", (-9, 0)),
    (qkv.or_masks(qkv.sliding_window(2), qkv.sliding_window(0, 3)), "band", (-2, 3)),
    (qkv.or_masks(qkv.causal, qkv.sliding_window(0, 7)), "band", (None, 7)),
    (qkv.and_masks(qkv.causal), "causal", (None, 0)),
    (qkv.or_masks(qkv.and_masks(qkv.causal, qkv.sliding_window(3))), "band", (-3, 0)),
    (qkv.and_masks(qkv.causal, qkv.and_masks(qkv.sliding_window(6), qkv.causal)), "band", (-6, 0)),
    (qkv.prefix_lm(4), "prefix", None),
    (qkv.and_masks(qkv.causal, qkv.document(_ids())), "and", None),
    (qkv.or_masks(qkv.sliding_window(1), lambda b, h, q, k: k == 0), "or", None),
    (qkv.or_masks(qkv.sliding_window(1), qkv.sliding_window(0, 9)), "band", (-1, 9)),
    (qkv.or_masks(qkv.sliding_window(1, 0), lambda b, h, q, k: q - k == 6), "or", None),
    (qkv.padding(torch.tensor([3, 40])), "padding", None),
    (qkv.document(_ids()), "document", None),
    (lambda b, h, q, k: (q - k) % 3 == 0, "mod", None),
]


def _what(m: MaskKind) -> str:
    """What the classified mask is, read from its class and terms (never a tag)."""
    if m.is_none:
        return "none"
    if m.is_causal:
        return "causal"
    if m.is_band:
        return "band"
    if m.is_user:
        return "mod"
    names = {Prefix: "prefix", And: "and", Or: "or", KvBelow: "padding", Document: "document"}
    return names[type(m.mask_mod)]


@pytest.mark.parametrize("mask,kind,band", CASES)
def test_kinds_and_simplification_keep_every_position(mask, kind, band):
    m = classify_mask(mask)
    assert _what(m) == kind, m.name
    if band is not None:
        assert (m.lo, m.hi) == band
    if mask is not None:
        assert torch.equal(_grid(m.mask_mod), _grid(mask)), m.name  # the simplified mask_mod


def test_intersections_and_unions_at_the_edges():
    diag = classify_mask(qkv.and_masks(qkv.sliding_window(0, 3), qkv.sliding_window(4, 0)))
    assert _what(diag) == "band" and (diag.lo, diag.hi) == (0, 0)  # the diagonal only
    # Bands with a gap between them stay an "or" of two bands (a band has no hole).
    gap = qkv.or_masks(band(-1, 0).mask_mod, band(5, 9).mask_mod)
    m = classify_mask(gap)
    assert _what(m) == "or" and [_what(p) for p in m.parts] == ["band", "band"]
    assert torch.equal(_grid(m.mask_mod), _grid(gap))
    # An empty intersection (lo > hi: a KV-cache shift can make one) hides every key: output
    # 0 and lse -inf, never NaN, and the compiled kernel is not asked to run it.
    empty = qkv.and_masks(band(3, 9).mask_mod, band(-9, 1).mask_mod)
    assert _what(classify_mask(empty)) == "band"
    q = torch.randn(1, 2, 17, 8)
    out, lse = qkv.attention(q, q, q, mask=empty, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    assert "compiled band kernel" not in qkv.plan(q, q, q, mask=empty).forward


def test_and_of_causal_and_window_takes_the_band_kernel():
    """The mask transformers builds for every sliding-window model reaches the kernel of the
    sliding window it equals, with the same numbers."""
    q, k, v = (torch.randn(1, 4, 300, 32) for _ in range(3))
    both = qkv.and_masks(qkv.causal, qkv.sliding_window(64))
    plan = qkv.plan(q, k, v, mask=both)
    same = qkv.plan(q, k, v, mask=qkv.sliding_window(64))
    assert plan.backend == same.backend and plan.forward == same.forward
    assert "= qkv.sliding_window(64)" in plan.mask
    torch.testing.assert_close(
        qkv.attention(q, k, v, mask=both), qkv.attention(q, k, v, mask=qkv.sliding_window(64))
    )


def test_prefix_lm_spelled_as_or_is_planned_as_prefix():
    q = torch.randn(1, 2, 260, 16)
    spelled = qkv.or_masks(qkv.causal, lambda b, h, q, k: k < 0)  # a mod: not a prefix
    assert _what(classify_mask(spelled)) == "or"
    plan = qkv.plan(q, q, q, mask=qkv.prefix_lm(40), return_lse=True)
    assert "prefix and causal parts" in plan.forward


def test_a_kv_cache_prefill_is_causal_and_reaches_sdpa_is_causal():
    """The module's prefill shifts qkv.causal by 0: the shifted band is still causal, so SDPA's
    is_causal path runs (it missed it when identity decided what was causal)."""
    prefill = mask_at(qkv.causal, 0, 0, 40, 40)
    assert _what(classify_mask(prefill)) == "causal"
    q = torch.randn(1, 2, 40, 16)  # 40 rows: a prefill (a few rows would be the decode kernel's)
    plan = qkv.plan(q, q, q, mask=prefill)
    assert plan.backend == "sdpa" and "is_causal" in plan.forward
    chunk = mask_at(qkv.causal, 5, 0, 3, 8)  # 5 cached + 3 new: a band, not top-left causal
    assert _what(classify_mask(chunk)) == "band"


def test_a_block_mask_carries_its_kind():
    bm = qkv.block_mask(qkv.and_masks(qkv.causal, qkv.sliding_window(16)), None, None, 64, 64)
    assert _what(bm.kind) == "band" and bm.kind.block is bm
    q = torch.randn(1, 2, 64, 16)
    torch.testing.assert_close(
        qkv.attention(q, q, q, mask=bm), qkv.reference.attention(q, q, q, mask=bm)[0]
    )


@pytest.mark.parametrize(
    "score,kind",
    [
        (None, "none"),
        (torch.zeros(1, 1, 4, 4), "bias"),
        (qkv.alibi(qkv.alibi_slopes(2)), "alibi"),
        (qkv.softcap(5.0), "softcap"),
        (qkv.relative_bias(torch.zeros(3, 2), 1), "relative"),
        (lambda s, b, h, q, k: s * 2, "mod"),
    ],
)
def test_score_kinds(score, kind):
    sc = classify_score(score)
    assert sc.is_none == (kind == "none")
    assert (sc.bias is not None) == (kind == "bias")
    assert sc.is_user == (kind == "mod")
    assert sc.is_callable == (kind not in ("none", "bias"))
    if kind not in ("none", "bias", "mod"):
        assert sc.score_mod is score  # a built-in stays the value it is


def test_unknown_mask_type_is_a_clear_type_error():
    with pytest.raises(TypeError, match="mask must be None, a bool tensor"):
        qkv.attention(torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8), mask=3)

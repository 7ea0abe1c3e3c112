"""Repeat calls (qkv._plain): a kept decision must never outlive what it was made from.

A call's route is kept per signature and rerun from the tensors alone; masks that carry
tensors (document ids, padding lengths) are keyed on those tensors' versions, so editing them
in place gives a new decision, and every kept runner gives the oracle's answer.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from catalogue import Shape, make_qkv

SMALL = Shape(4, 4, 2, 48, 48, 32)


def _oracle(q, k, v, mask):
    out, _ = qkv.reference.attention(q.double(), k.double(), v.double(), mask=mask)
    return out


def _close(a, b) -> bool:
    return bool((a.double() - b).abs().max() < 1e-5)


@pytest.fixture(autouse=True)
def _fresh():
    qkv._plain._ROUTES.clear()
    yield
    qkv._plain._ROUTES.clear()


def test_a_document_mask_edited_in_place_is_a_new_signature():
    q, k, v = make_qkv(SMALL, gen=1)
    ids = torch.arange(48) // 16
    mask = qkv.document(ids)
    for _ in range(2):  # the second call runs the kept runner
        assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))
    assert len(qkv._plain._ROUTES) == 1
    ids[:20] = 7  # in place: the same mask object, other documents
    assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))


def test_padding_lengths_edited_in_place_are_a_new_signature():
    q, k, v = make_qkv(SMALL, gen=2)
    lengths = torch.tensor([40, 48, 30, 20])
    mask = qkv.padding(lengths)
    for _ in range(2):
        assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))
    lengths[0] = 5
    assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))


def test_a_decode_step_with_padding_is_kept_and_exact():
    q, k, v = make_qkv(Shape(2, 8, 2, 1, 300, 64), gen=3)
    lengths = torch.tensor([300, 123])
    mask = qkv.padding(lengths)
    assert qkv.plan(q, k, v, mask=mask).backend == "decode"
    for _ in range(2):
        assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))
    assert len(qkv._plain._ROUTES) == 1
    lengths[1] = 7
    assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))


def test_a_window_without_gradients_runs_the_band_kernel_directly():
    q, k, v = make_qkv(SMALL, gen=4)
    mask = qkv.sliding_window(8)
    if qkv.plan(q, k, v, mask=mask).backend != "blocksparse":
        pytest.skip("the compiled band kernel is unavailable here")
    for _ in range(2):
        assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))
    assert len(qkv._plain._ROUTES) == 1
    # with gradients the signature differs, and the full path (with its backward) runs
    qg = q.clone().requires_grad_()
    out = qkv.attention(qg, k, v, mask=mask)
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_qkv_native_is_part_of_the_signature(monkeypatch):
    q, k, v = make_qkv(SMALL, gen=5)
    mask = qkv.sliding_window(8)
    qkv.attention(q, k, v, mask=mask)
    monkeypatch.setenv("QKV_NATIVE", "0")  # the planner reads it: a kept route must not
    out = qkv.attention(q, k, v, mask=mask)
    assert _close(out, _oracle(q, k, v, mask))
    assert "compiled band kernel" not in qkv.plan(q, k, v, mask=mask).forward


def test_a_padding_mask_of_int32_lengths_sees_an_in_place_edit():
    """The mask keeps an int64 copy of int32 lengths per device: keyed on their version, so
    an in-place edit is never answered from a stale copy."""
    lengths = torch.tensor([10, 10], dtype=torch.int32)
    mask = qkv.padding(lengths)
    idx = (torch.arange(2).view(2, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long))
    idx += (torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(10).view(1, 1, 1, 10))
    assert mask(*idx).sum() == 20
    lengths[0] = 3
    assert mask(*idx).sum() == 13


def test_masks_made_under_inference_mode_take_the_full_path():
    """Inference tensors have no version counter: such masks are never keyed on one."""
    q, k, v = make_qkv(SMALL, gen=6)
    with torch.inference_mode():
        ids = torch.arange(48) // 16
        lengths = torch.tensor([40, 48, 30, 20])
        for mask in (qkv.document(ids), qkv.padding(lengths)):
            for _ in range(2):
                assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))
        ids[:20] = 5  # in place, inside inference mode
        mask = qkv.document(ids)
        assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))

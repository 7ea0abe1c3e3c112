"""Repeat calls (plans kept by signature): a kept decision must never outlive what it was made from.

A call's route is kept per signature and rerun from the tensors alone; masks that carry
tensors (document ids, padding lengths) are keyed on those tensors' versions, so editing them
in place gives a new decision, and every kept runner gives the oracle's answer.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from catalogue import LAYOUTS, Shape, lay_out, make_qkv

SMALL = Shape(4, 4, 2, 48, 48, 32)


def _oracle(q, k, v, mask):
    out, _ = qkv.reference.attention(q.double(), k.double(), v.double(), mask=mask)
    return out


def _close(a, b) -> bool:
    return bool((a.double() - b).abs().max() < 1e-5)


@pytest.fixture(autouse=True)
def _fresh():
    qkv._planning.kept.clear()
    yield
    qkv._planning.kept.clear()


def test_a_document_mask_edited_in_place_is_a_new_signature():
    q, k, v = make_qkv(SMALL, gen=1)
    ids = torch.arange(48) // 16
    mask = qkv.document(ids)
    for _ in range(2):  # the second call runs the kept runner
        assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))
    assert len(qkv._planning.kept._KEPT) == 1
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
    assert len(qkv._planning.kept._KEPT) == 1
    lengths[1] = 7
    assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))


def test_a_window_without_gradients_runs_the_band_kernel_directly():
    q, k, v = make_qkv(SMALL, gen=4)
    mask = qkv.sliding_window(8)
    if qkv.plan(q, k, v, mask=mask).backend != "blocksparse":
        pytest.skip("the compiled band kernel is unavailable here")
    for _ in range(2):
        assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))
    assert len(qkv._planning.kept._KEPT) == 1
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


# ---------------------------------------------------- the decision apart from the tensors

_KEPT_CASES = {
    "none": lambda L: None,
    "causal": lambda L: qkv.causal,
    "window": lambda L: qkv.sliding_window(8),
    "document_sorted": lambda L: qkv.document(torch.arange(L) // 16),
    "document_mixed": lambda L: qkv.document(torch.arange(L) % 3),
    "padding": lambda L: qkv.padding(torch.tensor([40, 48, 30, 20])),
    "prefix": lambda L: qkv.prefix_lm(10),
    "causal_documents": lambda L: qkv.and_masks(qkv.causal, qkv.document(torch.arange(L) % 3)),
}
_KEPT_SCORES = {
    "alibi": lambda H: qkv.alibi(qkv.alibi_slopes(H)),
    "softcap": lambda H: qkv.softcap(5.0),
    "relative": lambda H: qkv.relative_bias(torch.randn(17, H, requires_grad=True), 8),
}


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", list(_KEPT_CASES))
def test_a_kept_plan_holds_none_of_the_calls_tensors(case, grad):
    """Plans are kept under the call's signature, and hold none of the call's tensors: once
    the caller lets q, k, v (and their gradients) go, they are freed, plan kept or not. Run
    twice, the second call taking the kept plan, both equal to the oracle."""
    import gc
    import weakref

    q, k, v = make_qkv(SMALL, gen=11, requires_grad=grad)
    mask = _KEPT_CASES[case](48)
    for _ in range(2):
        out = qkv.attention(q, k, v, mask=mask)
        assert _close(out, _oracle(q.detach(), k.detach(), v.detach(), mask))
        if grad:
            out.sum().backward()
    assert any(e is not None for e in qkv._planning.kept._KEPT.values()), "nothing was kept"
    refs = [weakref.ref(t) for t in (q, k, v)]
    del q, k, v, out
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True], "a kept plan holds the tensors"


@pytest.mark.parametrize("case", list(_KEPT_SCORES))
def test_a_built_in_score_mod_is_kept_and_bound_per_call(case):
    """A built-in score_mod is part of the signature weakly: its decision is kept, and each
    call runs with that call's tensors (the second call's q is another tensor), equal to the
    oracle, gradients included; the kept plan holds none of them."""
    import gc
    import weakref

    mod = _KEPT_SCORES[case](4)
    for gen in (15, 16):
        q, k, v = make_qkv(Shape(2, 4, 4, 40, 40, 16), gen=gen, requires_grad=True)
        out = qkv.attention(q, k, v, mask=qkv.causal, score_mod=mod)
        ref = qkv.reference.attention(q, k, v, mask=qkv.causal, score_mod=mod)[0]
        assert _close(out, ref.double())
        g = torch.autograd.grad(out.sum(), (q, k))
        g_ref = torch.autograd.grad(ref.sum(), (q, k))
        assert all(_close(a, b.double()) for a, b in zip(g, g_ref, strict=True))
    assert any(e is not None for e in qkv._planning.kept._KEPT.values()), "nothing was kept"
    refs = [weakref.ref(t) for t in (q, k, v)]
    del q, k, v, out, ref, g, g_ref
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True], "a kept plan holds the tensors"


def _counting(monkeypatch):
    """The list of planner decisions made from now on (qkv.plan's dry runs not counted)."""
    from qkv import planner

    decided = []
    real = planner._decide

    def count(*a, **kw):
        if not kw["dry_run"]:
            decided.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(planner, "_decide", count)
    return decided


def test_a_repeat_call_is_not_decided_again(monkeypatch):
    """A kept signature is decided once, also where the route has per-call work (a window
    with gradients: the door runs, the planner does not); a new ids tensor is a new one."""

    decided = _counting(monkeypatch)
    q, k, v = make_qkv(SMALL, gen=12, requires_grad=True)
    for mask in (qkv.sliding_window(8), qkv.document(torch.arange(48) % 3)):
        for _ in range(3):
            out = qkv.attention(q, k, v, mask=mask)
            out.sum().backward()
            assert _close(out, _oracle(q.detach(), k.detach(), v.detach(), mask))
    assert len(decided) == 2
    mask = qkv.document(torch.arange(48) % 3)  # same values, another tensor
    qkv.attention(q, k, v, mask=mask)
    assert len(decided) == 3


def test_huge_logits_keep_a_plan_for_each_answer(monkeypatch):
    """A decision that read the logits (SDPA's backward loses precision past a bound) is
    kept per answer: ordinary, huge, and ordinary again each run their own backend, each
    decided once."""

    decided = _counting(monkeypatch)  # (qkv.plan decides too, with dry_run: not counted)
    shape = Shape(1, 2, 2, 48, 48, 32)
    q, k, v = make_qkv(shape, gen=13, requires_grad=True)
    huge = [(t.detach() * 100).requires_grad_() for t in (q, k)]
    backends = []
    for qq, kk in ((q, k), huge, (q, k), huge):
        qkv.attention(qq, kk, v, mask=qkv.causal).sum().backward()
        backends.append(qkv.plan(qq, kk, v, mask=qkv.causal).backend)
    assert backends == ["sdpa", "blocksparse", "sdpa", "blocksparse"]
    assert len(decided) == 2
    by_answer = sorted(
        (key[1], e.plan.backend)
        for key, e in qkv._planning.kept._KEPT.items()
        if isinstance(key[1], bool)
    )
    assert by_answer == [(False, "sdpa"), (True, "blocksparse")]


@pytest.mark.parametrize("case", list(_KEPT_CASES))
def test_a_calls_signature_equals_its_problems(case):
    """The signature made from a call's arguments (the repeat-call path, before any check)
    is the one the planner keeps the validated problem's plan under."""
    from qkv import planner
    from qkv._door import validate
    from qkv._planning import signature

    q, k, v = make_qkv(SMALL, gen=14)
    mask = _KEPT_CASES[case](48)
    limit = planner.dense_limit()
    for grad in (False, True):
        qq = q.clone().requires_grad_(grad)
        of_call = signature.of_call(qq, k, v, mask, None, False, "auto", limit)
        of_problem = signature.of_problem(validate(qq, k, v, mask=mask), "auto", limit)
        assert of_call is not None and of_call == of_problem and hash(of_call) == hash(of_problem)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
        assert signature.of_call(q, k, v, mask, None, False, "auto", limit) != of_call
    finally:
        torch.set_num_threads(threads)


def test_a_user_score_mod_is_kept_and_reads_its_tensors_at_each_call(monkeypatch):
    """A user's score_mod is part of the signature weakly: the decision is kept (decided
    once), and each call reads the tensors it closes over as they are then (an in-place
    edit shows at once), gradients into them included, equal to the oracle."""

    decided = _counting(monkeypatch)
    scale = torch.tensor([0.5], requires_grad=True)

    def tilt(score, b, h, q_idx, kv_idx):
        return score + scale * (kv_idx - q_idx).float() / 10

    q, k, v = make_qkv(Shape(1, 2, 2, 200, 200, 16), gen=17, requires_grad=True)
    for value in (0.5, -2.0):
        with torch.no_grad():
            scale.fill_(value)  # in place: the same mod, another tilt
        out = qkv.attention(q, k, v, mask=qkv.causal, score_mod=tilt)
        q64, k64, v64 = (t.double() for t in (q, k, v))  # (the oracle in float64)
        ref = qkv.reference.attention(q64, k64, v64, mask=qkv.causal, score_mod=tilt)[0]
        assert _close(out, ref)
        got = torch.autograd.grad(out.sum(), (q, scale))
        want = torch.autograd.grad(ref.sum(), (q, scale))
        for a, b in zip(got, want, strict=True):  # (scale's: a sum over 40 K scores)
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)
    assert len(decided) == 1


@pytest.mark.parametrize(
    ("L", "backend"),
    [(40, "auto"), (600, "auto"), (40, "triton")],
    ids=["sdpa", "blocksparse", "triton"],
)
@pytest.mark.parametrize("kind", ["mask_mod", "bool_tensor", "block_mask", "and_mod"])
def test_unwatched_masks_keep_the_decision_and_plan_tiles_per_call(monkeypatch, kind, L, backend):
    """A mask whose values a signature cannot watch (a user's mask_mod and the tensor it
    closes over, a bool tensor, a block mask, a combination with a mod): its decision is
    kept (decided once), its tiles are planned again at every call, so an in-place edit of
    what it reads shows at once; every call equals the oracle, with gradients."""
    if backend == "triton" and kind == "block_mask":
        pytest.skip("a block mask is planned for blocksparse's tiles")
    decided = _counting(monkeypatch)
    keep = torch.zeros(L, dtype=torch.bool)
    keep[: L // 3] = True

    def visible(b, h, q_idx, kv_idx):
        return keep[kv_idx] | (q_idx == kv_idx)

    dense = torch.zeros(1, 1, L, L, dtype=torch.bool)
    q, k, v = make_qkv(Shape(1, 4, 4, L, L, 16), gen=18, requires_grad=True)
    made = {  # one object for every call, as a model's layers pass theirs
        "mask_mod": lambda: visible,
        "bool_tensor": lambda: dense,
        "block_mask": lambda: qkv.block_mask(visible, None, None, L, L),
        "and_mod": lambda: qkv.and_masks(qkv.causal, visible),
    }
    mask = made[kind]()
    for step in range(3):
        dense.copy_(visible(None, None, torch.arange(L)[:, None], torch.arange(L)[None]))
        if kind == "block_mask" and step > 0:
            break  # (a block mask is a plan of the mask as it was: nothing to edit)
        out = qkv.attention(q, k, v, mask=mask, backend=backend)
        ref = qkv.reference.attention(*(t.double() for t in (q, k, v)), mask=mask)[0]
        assert _close(out, ref)
        got = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(ref.sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)
        keep[L // 3 :] = ~keep[L // 3 :]  # in place: the next call sees other keys
        keep[: L // 5] = False
    assert len(decided) == 1
    import gc
    import weakref

    refs = [weakref.ref(t) for t in (q, k, v)]
    del q, k, v, out, ref, got, want
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True], "a kept plan holds the tensors"


def test_a_plan_kept_for_freed_tensors_is_forgotten():
    """A training loop packs new documents at every step: each step's ids are a new
    signature, and when the step's mask is freed its kept plan (and the dense mask its runner
    holds) is forgotten, so the store does not grow with the steps."""
    store = qkv._planning.kept
    q, k, v = make_qkv(SMALL, gen=19)
    for step in range(40):
        ids = (torch.arange(48) + step) // 16  # another packing each step
        mask = qkv.document(ids)
        for _ in range(2):
            assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask))
        assert len(store._KEPT) <= 2, "plans of freed masks were kept"
        del ids, mask
    assert len(store._KEPT) <= 1 and len(store._GUARDS) <= 1


@pytest.mark.parametrize(
    ("case", "shape"),
    [
        ("none", Shape(1, 9, 3, 1, 64, 64)),  # a decode step: the decode kernel's runner
        ("causal", SMALL),
        ("window", SMALL),  # the compiled band kernel's runner (no gradient)
        ("document_mixed", SMALL),
        ("padding", SMALL),
    ],
    ids=["decode", "causal", "window", "document", "padding"],
)
def test_a_kept_plan_takes_every_memory_layout_and_a_nan(case, shape):
    """A signature holds no strides: the plan (and runner) kept from a contiguous first call
    runs later calls in every memory layout, equal to the oracle, and a NaN in a later call's
    keys reaches every row that sees it (the contract lets it reach rows the mask hides it
    from too: SDPA's dense mask does; the rows left finite equal the oracle)."""
    q0, k0, v0 = make_qkv(shape, gen=24)
    mask = _KEPT_CASES[case](shape.Lk)
    assert _close(qkv.attention(q0, k0, v0, mask=mask), _oracle(q0, k0, v0, mask))
    for layout in LAYOUTS:
        q, k, v = (lay_out(t, layout) for t in make_qkv(shape, gen=25))
        assert _close(qkv.attention(q, k, v, mask=mask), _oracle(q, k, v, mask)), layout
    k = k0.clone()
    k[..., 0, :] = float("nan")  # key 0: every row that may attend to it gives NaN
    out = qkv.attention(q0, k, v0, mask=mask)
    want = _oracle(q0, k, v0, mask)
    assert bool(want.isnan().any()) and bool(out.isnan()[want.isnan()].all())
    fine = ~out.isnan()
    assert bool(((out.double() - want).abs()[fine] < 1e-5).all())

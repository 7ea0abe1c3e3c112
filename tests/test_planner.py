"""backend="auto" and qkv.plan: sdpa where the problem maps onto torch's kernel directly,
blocksparse otherwise, the reference never silently beyond the dense limit; plans explain
themselves."""

from __future__ import annotations

import time

import pytest
import torch

import qkv
from qkv import planner  # private: the backend registry and auto's order are the unit tested


def _x(B=1, Hq=4, Hkv=4, Lq=256, Lk=256, D=16, device="cpu"):
    q = torch.randn(B, Hq, Lq, D, device=device)
    k = torch.randn(B, Hkv, Lk, D, device=device)
    return q, k, k


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"mask": qkv.causal},
        {"score_mod": torch.randn(256, 256)},
        {"dropout_p": 0.1},
    ],
    ids=["none", "causal", "bias", "dropout"],
)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_auto_picks_sdpa_where_it_maps_directly(kw, heads):
    q, k, v = _x(Hq=heads[0], Hkv=heads[1])
    plan = qkv.plan(q, k, v, **kw)
    assert plan.backend == "sdpa"
    assert plan.rejected == {}


@pytest.mark.parametrize(
    "kw,why",
    [
        ({"mask": qkv.sliding_window(16)}, "estimated cost"),
        ({"mask": qkv.document(torch.arange(512) // 100)}, "estimated cost"),
        ({"mask": lambda b, h, q, k: q // 128 == k // 128}, "estimated cost"),
        ({"mask": torch.arange(512)[:, None] // 64 == torch.arange(512) // 64}, "estimated cost"),
        ({"mask": qkv.block_mask(qkv.sliding_window(64), 1, 8, 512, 512)}, "estimated cost"),
        ({"return_lse": True}, "log-sum-exp"),
        ({"mask": qkv.causal, "return_lse": True}, "log-sum-exp"),
        ({"score_mod": qkv.softcap(20.0)}, "score_mod"),
        ({"score_mod": qkv.alibi(qkv.alibi_slopes(8)), "mask": qkv.causal}, "score_mod"),
    ],
    ids=[
        "window",
        "document",
        "mask_mod",
        "bool",
        "block_mask",
        "lse",
        "causal_lse",
        "softcap",
        "alibi",
    ],
)
def test_auto_picks_blocksparse_otherwise(kw, why):
    q, k, v = _x(Hq=8, Hkv=8, Lq=512, Lk=512, D=64)  # (masks that leave a third or less)
    plan = qkv.plan(q, k, v, **kw)
    assert plan.backend == "blocksparse"
    assert why in plan.rejected["sdpa"]
    # auto really runs it, and it is right.
    out = qkv.attention(q, k, v, **kw)
    out = out[0] if isinstance(out, tuple) else out
    ref, _ = qkv.reference.attention(q, k, v, mask=kw.get("mask"), score_mod=kw.get("score_mod"))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "mask",
    [
        lambda b, h, q, k: (q - k) % 2 == 0,
        torch.rand(512, 512, generator=torch.Generator().manual_seed(0)) > 0.5,
        qkv.block_mask(lambda b, h, q, k: (q - k) % 3 != 0, 1, 8, 512, 512),
    ],
    ids=["mask_mod", "bool", "block_mask"],
)
def test_auto_keeps_sdpa_where_the_mask_hides_little(mask):
    """A mask that leaves a score in every tile gives the engine nothing to skip and many
    smaller calls: auto weighs both and keeps SDPA with the dense mask, and says so with
    the estimates; the engine's estimate is above SDPA's."""
    q, k, v = _x(Hq=8, Hkv=8, Lq=512, Lk=512)
    plan = qkv.plan(q, k, v, mask=mask)
    assert plan.backend == "sdpa", str(plan)
    weighed = [n for n in plan.notes if n.startswith("auto kept sdpa: estimated cost")]
    assert len(weighed) == 1, plan.notes
    got = qkv.attention(q, k, v, mask=mask)
    ref, _ = qkv.reference.attention(q, k, v, mask=mask)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_the_estimates_follow_the_work_a_mask_leaves():
    """The engine's estimated share of SDPA's cost grows with a window's width, and auto's
    choice flips from the engine to SDPA where the estimate passes the margin."""
    from qkv._door import validate
    from qkv.backends import BACKENDS
    from qkv.backends.blocksparse.cost import MARGIN

    q, k, v = _x(Hq=8, Hkv=8, Lq=2048, Lk=2048)
    ratios = []
    for w in (64, 512, 2047):  # (tile granularity: finer steps need not be monotonic)
        mask = lambda b, h, i, j, w=w: (i - j).abs() <= w  # noqa: E731 (a user's mask_mod)
        costs = BACKENDS["blocksparse"].weigh(validate(q, k, v, mask=mask))
        ratios.append(costs.ratio)
        want = "blocksparse" if costs.ratio < MARGIN else "sdpa"
        assert qkv.plan(q, k, v, mask=mask).backend == want, (w, costs)
    assert ratios == sorted(ratios) and ratios[0] < MARGIN < ratios[-1], ratios


@pytest.mark.parametrize(
    "mask",
    [qkv.sliding_window(16), lambda b, h, i, j: (i - j) % 2 == 0, torch.rand(64, 64) > 0.5],
    ids=["window", "mask_mod", "bool"],
)
def test_small_masked_problems_go_to_sdpa(mask, torch_kernels):
    """Below ~1 M scores SDPA's one dense call beats planning tiles (measured). (Sliding
    windows go to the compiled band kernel when there is one: test_native.py.)"""
    q, k, v = _x(Hq=4, Hkv=4, Lq=64, Lk=64)
    assert qkv.plan(q, k, v, mask=mask).backend == "sdpa"
    assert qkv.plan(q, k, v, mask=mask, return_lse=True).backend == "blocksparse"
    ref, _ = qkv.reference.attention(q, k, v, mask=mask)
    torch.testing.assert_close(qkv.attention(q, k, v, mask=mask), ref, rtol=1e-4, atol=1e-5)


def test_plan_explains_itself():
    q, k, v = _x(Lq=4096, Lk=4096, D=64, Hq=8, Hkv=8)
    plan = qkv.plan(q, k, v, mask=qkv.sliding_window(256))
    text = str(plan)
    assert "backend 'blocksparse'" in text
    assert "sdpa:" in text and "dense" in text  # why SDPA was passed over
    assert "density 6.1%" in text  # exact for a band: (257*4096 - 256*257/2) / 4096²
    assert "tiles" in text and "of 1024 tiles of 128x128" in text
    assert plan.block_density is not None and 0.061 < plan.block_density < 0.1
    want = 4 * 8 * 64 * (257 * 4096 - 256 * 257 / 2)  # 2 matmuls x 2 FLOPs, visible pairs only
    assert plan.flops == pytest.approx(want)
    assert plan.extra_memory < 64 << 20


def test_plan_for_document_masks_uses_tile_density():
    ids = torch.arange(4096) // 512  # 8 documents of 512
    q, k, v = _x(Lq=4096, Lk=4096)
    plan = qkv.plan(q, k, v, mask=qkv.and_masks(qkv.causal, qkv.document(ids)))
    assert plan.density is None  # not known exactly without evaluating positions...
    assert plan.block_density == pytest.approx(8 * (4 * 5 / 2) / 32**2)  # ...but tiles are
    assert "FLOPs count every position of visible tiles" in str(plan)


def test_plan_on_meta_tensors_costs_nothing_and_is_bounded():
    """`qkv plan` uses meta tensors: even n = 65536 plans instantly, and the engine's
    estimated extra memory for a 256 window stays far below the 128 GiB of dense scores."""
    q = torch.empty(1, 8, 65536, 64, device="meta")
    t = time.perf_counter()
    plan = qkv.plan(q, q, q, mask=qkv.sliding_window(256))
    assert time.perf_counter() - t < 5.0
    assert plan.backend == "blocksparse"
    assert plan.extra_memory < 256 << 20
    plan = qkv.plan(q, q, q, mask=lambda b, h, i, j: i >= j)
    assert "evaluated on meta tensors" in str(plan)


def test_dense_limit_refuses_the_reference_but_auto_never_raises():
    q, k, v = _x(Lq=512, Lk=512)
    old = qkv.set_dense_limit(1 << 20)
    try:
        with pytest.raises(ValueError, match="dense limit"):
            qkv.attention(q, k, v, mask=qkv.causal, backend="reference")
        plan = qkv.plan(q, k, v, mask=lambda b, h, i, j: i >= j, return_lse=True)
        assert plan.backend == "blocksparse"
        _, lse = qkv.attention(q, k, v, mask=lambda b, h, i, j: i >= j, return_lse=True)
        assert torch.isfinite(lse).all()
    finally:
        qkv.set_dense_limit(old)


def test_named_backends(torch_kernels):
    q, k, v = _x()
    with pytest.raises(ValueError, match="'blocksparse'"):
        qkv.attention(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="log-sum-exp"):
        qkv.attention(q, k, v, backend="sdpa", return_lse=True)
    plan = qkv.plan(q, k, v, backend="blocksparse")
    assert plan.backend == "blocksparse"
    assert "whole problem" in plan.forward
    plan = qkv.plan(q, k, v, backend="blocksparse", mask=qkv.sliding_window(8))
    assert "batched along the band" in plan.forward
    plan = qkv.plan(q, k, v, backend="blocksparse", mask=lambda b, h, i, j: i % 3 != j % 2)
    assert "per query block, visible key blocks only" in plan.forward
    ids = torch.arange(256) // 64
    plan = qkv.plan(
        q, k, v, mask=qkv.and_masks(qkv.causal, qkv.document(ids)), backend="blocksparse"
    )
    assert "once per document (4 calls)" in plan.forward
    plan = qkv.plan(q, k, v, backend="blocksparse", score_mod=qkv.softcap(5.0))
    assert "explicit matmuls" in plan.forward


def test_auto_order_and_registry():
    assert planner.AUTO_ORDER == ["sdpa", "decode", "triton", "blocksparse", "reference"]
    assert set(planner.BACKENDS) == {"sdpa", "decode", "triton", "blocksparse", "reference"}


def test_cli_plan_shows_blocksparse(capsys, torch_kernels):
    from qkv.cli import main

    assert main(["plan", "--q-len", "16384", "--mask", "window:256"]) == 0
    out = capsys.readouterr().out
    assert "blocksparse" in out and "tiles" in out and "batched along the band" in out


# ------------------------------------------- repeat calls without a mask (plans kept by signature)


def test_repeat_calls_reuse_the_decision_and_stay_exact(monkeypatch):
    """A second call of one signature (no mask, no score_mod) skips the door and the
    planner, and computes the same as the first and the oracle; anything that changes the
    signature takes the full path again."""
    from qkv import functional

    qkv._planning.kept.clear()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 1, 64, generator=gen)
    k = torch.randn(1, 3, 40, 64, generator=gen)
    v = torch.randn(1, 3, 40, 64, generator=gen)
    calls = []
    real = functional.validate
    monkeypatch.setattr(functional, "validate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    first = qkv.attention(q, k, v)
    second = qkv.attention(q, k, v)
    assert len(calls) == 1, "the second call of the signature validated again"
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    ref = qkv.attention(q.double(), k.double(), v.double(), backend="reference")
    torch.testing.assert_close(second.double(), ref, atol=1e-6, rtol=1e-5)
    qkv.attention(q, k[:, :, :39], v[:, :, :39])  # another cache length: a new signature
    qkv.attention(q, k, v, scale=0.5)
    qg = q.clone().requires_grad_()
    out = qkv.attention(qg, k, v)
    out.sum().backward()  # autograd flags are part of the signature
    assert qg.grad is not None and len(calls) == 5  # + the reference's own call
    # a bad call never reaches the cache: the full door refuses it
    with pytest.raises(ValueError, match="q heads must be a multiple"):
        qkv.attention(torch.randn(1, 8, 1, 64), k, v)
    # routes that hold per-call work (lse from blocksparse, with a gradient) keep their
    # decision but no runner: the door runs every call
    before = dict(qkv._planning.kept._KEPT.items())
    assert qkv.plan(qg, k, v, return_lse=True).backend == "blocksparse"
    qkv.attention(qg, k, v, return_lse=True)
    new = [e for key, e in qkv._planning.kept._KEPT.items() if key not in before and e is not None]
    assert [(e.plan.backend, e.runner) for e in new] == [("blocksparse", None)]
    qkv.attention(qg, k, v, return_lse=True)
    assert len(calls) == 8  # (the refused call validated too)


@pytest.mark.parametrize(
    "mask",
    [qkv.causal, qkv.sliding_window(5), qkv.sliding_window(3, 2)],
    ids=["causal", "window", "window_both"],
)
@pytest.mark.parametrize("shape", [(1, 8, 2, 40, 40), (2, 9, 3, 1, 30)], ids=["prefill", "decode"])
def test_repeat_calls_with_a_band_mask_reuse_the_decision(monkeypatch, mask, shape):
    """A band mask object (what every layer of a forward shares) is part of the signature:
    where the route has a runner (SDPA's is_causal, the decode kernel, the compiled band
    kernel without gradients) its second call skips
    the door, gives the first call's numbers and the oracle's; an equal band made anew is the
    same signature, another band another; a combination made anew at each call is a value too,
    and new or edited ids in it are a new signature."""
    from qkv import functional

    qkv._planning.kept.clear()
    B, Hq, Hkv, Lq, Lk = shape
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, Lq, 16, generator=gen)
    k, v = (torch.randn(B, Hkv, Lk, 16, generator=gen) for _ in range(2))
    calls = []
    real = functional.validate
    monkeypatch.setattr(functional, "validate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    plan = qkv.plan(q, k, v, mask=mask)
    backend = plan.backend
    first = qkv.attention(q, k, v, mask=mask)
    second = qkv.attention(q, k, v, mask=mask)
    # the compiled band kernel without gradients is bound once too
    if backend in ("sdpa", "decode") or "compiled band kernel" in plan.forward:
        assert len(calls) == 1, "the second call of the signature validated again"
    else:  # blocksparse's other routes hold per-call jobs: no runner is kept
        assert backend == "blocksparse" and len(calls) == 2
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(second, qkv.attention(q, k, v, mask=mask, backend="reference"))
    other = qkv.sliding_window(1)
    torch.testing.assert_close(
        qkv.attention(q, k, v, mask=other), qkv.attention(q, k, v, mask=other, backend="reference")
    )
    ids = torch.arange(Lq) // 4
    if Lq == Lk:
        # a combination made anew at each call is a value: equal parts, equal signature
        before = len(calls)
        first = qkv.attention(q, k, v, mask=qkv.and_masks(mask, qkv.document(ids)))
        again = qkv.attention(q, k, v, mask=qkv.and_masks(mask, qkv.document(ids)))
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        assert len(calls) <= before + 2
        # other ids (or the same ids edited in place) are another signature: decided again
        ids2 = ids.flip(0)
        want = qkv.attention(
            q, k, v, mask=qkv.and_masks(mask, qkv.document(ids2)), backend="reference"
        )
        torch.testing.assert_close(
            qkv.attention(q, k, v, mask=qkv.and_masks(mask, qkv.document(ids2))), want
        )
        ids2[:] = 0
        want = qkv.attention(
            q, k, v, mask=qkv.and_masks(mask, qkv.document(ids2)), backend="reference"
        )
        torch.testing.assert_close(
            qkv.attention(q, k, v, mask=qkv.and_masks(mask, qkv.document(ids2))), want
        )


def test_repeat_calls_follow_the_dense_limit():

    qkv._planning.kept.clear()
    q = k = v = torch.randn(1, 2, 64, 16)
    qkv.attention(q, k, v, dropout_p=0.0)
    ref = qkv.attention(q, k, v, backend="reference")
    old = qkv.set_dense_limit(0)
    try:
        assert qkv.plan(q, k, v).backend == "blocksparse"  # SDPA's lse buffer is over 0 B
        before = dict(qkv._planning.kept._KEPT.items())
        torch.testing.assert_close(qkv.attention(q, k, v), ref)
        # the limit is part of the signature: a new one, decided for blocksparse
        new = [e for key, e in qkv._planning.kept._KEPT.items() if key not in before]
        assert [e.plan.backend for e in new] == ["blocksparse"]
    finally:
        qkv.set_dense_limit(old)


def test_plan_takes_the_mask_positionally_as_attention_does():
    q = k = v = torch.randn(1, 2, 40, 8)
    assert str(qkv.plan(q, k, v, qkv.sliding_window(4))) == str(
        qkv.plan(q, k, v, mask=qkv.sliding_window(4))
    )

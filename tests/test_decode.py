"""qkv's compiled decode kernel (``src/qkv/backends/decode/kernels/decode.cpp``) against the
float64 oracle, the planner's choice of it, and what happens when it cannot be built.

The kernel runs a few query rows per kv head against many keys with the keys split across
threads, so the shapes here are decode shapes (Lq of 1-4, GQA/MQA, odd head dims, caches of
1 to 1025 keys) with every mask it takes (none, causal, windows, right/left padding, their
intersection), forced split counts (uneven and empty splits), rows that see no key and
strided caches. It has no backward: gradients are the other backends' (tested elsewhere);
here, that a call needing them is planned elsewhere.
"""

from __future__ import annotations

import functools
import logging
import re
import shutil
import statistics
import zlib

import pytest
import torch

import qkv
from catalogue import Shape, make_qkv
from qkv._core.lru import LRU

# private: the kernel's entry point with a forced split count, its library and row limit
from qkv._planning import signature
from qkv.backends import decode as decode_mod
from qkv_testing import assert_matches_oracle, compare_to_oracle

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None, reason="no C++ compiler to build qkv's CPU kernel"
)
decode = functools.partial(qkv.attention, backend="decode", return_lse=True)


def _forced(splits: int):
    """``qkv.attention``-shaped call that runs the kernel with ``splits`` key splits."""

    def run(q, k, v, *, mask=None, score_mod=None, scale=None):
        assert score_mod is None
        p = qkv._door.validate(q, k, v, mask=mask, scale=scale, return_lse=True)
        assert qkv.plan(q, k, v, mask=mask, scale=scale).backend == "decode"
        out, lse = decode_mod.forward(p, splits=splits)
        return p.restore(out), p.restore(lse)

    return run


def _masks(B: int, Lk: int, gen: torch.Generator) -> dict[str, object]:
    lengths = torch.randint(0, Lk + 1, (B,), generator=gen)
    start = (Lk - lengths) * torch.randint(0, 2, (B,), generator=gen)  # left- or right-padded
    lengths[0] = Lk  # one full row, and (next) one batch element with no key at all
    if B > 1:
        lengths[1] = 0
    w = max(1, Lk // 3)
    return {
        "none": None,
        "causal": qkv.causal,
        "window": qkv.sliding_window(w),
        "window_both": qkv.sliding_window(w, 2),
        "padding": qkv.padding(lengths, start=start),
        "window_and_padding": qkv.and_masks(
            qkv.sliding_window(w), qkv.padding(lengths, start=start)
        ),
    }


# (B, Hq, Hkv, Lq, Lk, D, Dv)
SHAPES = [
    (1, 9, 3, 1, 100, 64, 64),  # SmolLM2's decode step
    (2, 8, 2, 1, 1, 59, 59),  # one cached key
    (3, 4, 1, 2, 7, 111, 59),  # MQA, two rows, Dv != D
    (2, 6, 6, 1, 113, 16, 16),  # MHA
    (1, 8, 2, 4, 1025, 64, 32),  # 16 rows per kv head (the limit), a long cache
    (2, 2, 2, 3, 1025, 7, 7),  # a head dim below one vector
]
MASKS = ["none", "causal", "window", "window_both", "padding", "window_and_padding"]


@needs_compiler
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_kernel_matches_the_oracle(shape, mask):
    B, Hq, Hkv, Lq, Lk, D, Dv = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, mask)).encode()))
    q, k, v = make_qkv(Shape(B, Hq, Hkv, Lq, Lk, D, Dv), gen=gen)
    m = _masks(B, Lk, gen)[mask]
    plan = qkv.plan(q, k, v, mask=m)
    assert plan.backend == "decode", str(plan)
    assert_matches_oracle(compare_to_oracle(decode, q, k, v, mask=m, grads=False))


@needs_compiler
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64, 5000])
@pytest.mark.parametrize("mask", ["none", "window", "window_and_padding"])
def test_every_split_count_gives_the_same_answer(splits, mask):
    """Uneven splits, splits with no visible key (a window covers a few of them), more splits
    than keys: the merge by maxima and sums is exact whatever the cut."""
    shape = Shape(3, 8, 2, 2, 301, 59)
    gen = torch.Generator().manual_seed(splits)
    q, k, v = make_qkv(shape, gen=gen)
    m = _masks(shape.B, shape.Lk, gen)[mask]
    assert_matches_oracle(compare_to_oracle(_forced(splits), q, k, v, mask=m, grads=False))


@needs_compiler
def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k, v = make_qkv(Shape(3, 4, 2, 2, 50, 16), gen=1)
    pad = qkv.padding(torch.tensor([0, 50, 10]), start=torch.tensor([0, 0, 40]))
    ahead = qkv.and_masks(qkv.sliding_window(0, 0), pad)  # row i sees only key i
    for mask in (pad, ahead):
        out, lse = decode(q, k, v, mask=mask)
        want_out, want_lse = qkv.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
        assert torch.isfinite(out).all()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        torch.testing.assert_close(out, want_out)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # batch 0 has no key
    assert torch.isneginf(lse[2]).all()  # batch 2's keys start at 40: rows 0, 1 see none


@needs_compiler
@pytest.mark.parametrize("scale", [-0.3, 3.0])
def test_negative_scale_and_large_logits(scale):
    """The row maximum is taken after scaling (a negative scale flips it), and logits of a
    few hundred stay finite and as accurate as plain PyTorch's.

    Compared over 16 draws rather than one: at logits of ~500 a float32 score is off by up to
    half an ulp (3e-5) whoever computes it, and which of two float32 computations lands nearer
    the float64 oracle on one draw is luck. So the median and the mean are compared, not the
    largest error: over 200 draws the kernel's out errors (median / 90th percentile / largest)
    were 1.49e-6 / 3.97e-6 / 9.09e-6 against plain PyTorch's 1.65e-6 / 4.21e-6 / 9.10e-6 (AVX2
    build), but over eight blocks of 16 draws the ratio of the two largest errors ranged
    0.24-4.71 (the mean's 0.38-1.85) under AVX2 and under AVX-512 alike."""
    errors: dict[str, tuple[list[float], list[float]]] = {"out": ([], []), "lse": ([], [])}
    for seed in range(16):
        q, k, v = make_qkv(Shape(1, 4, 2, 1, 500, 32), gen=seed)
        for c in compare_to_oracle(decode, q * 10, k, v, scale=scale, grads=False):
            assert c.err < 1e-3, c  # finite, and the right maximum
            errors[c.name][0].append(c.err)
            errors[c.name][1].append(c.plain_err)
    ulp = 6.2e-5  # of a float32 lse between 512 and 1024: lse errors come in these steps
    for name, (ours, plain) in errors.items():
        floor = ulp if name == "lse" else 1e-6
        assert statistics.median(ours) <= 2 * statistics.median(plain) + floor, name
        assert statistics.fmean(ours) <= 2 * statistics.fmean(plain) + floor, name


@needs_compiler
def test_a_strided_cache_is_read_in_place():
    """K/V as views of a preallocated ``[B, H, max_len, D]`` cache (qkv.KVCache, static
    caches) go to the kernel as they are; a transposed last dim is made contiguous first."""
    q, k, v = make_qkv(Shape(2, 8, 2, 1, 300, 64), gen=3)
    kbuf, vbuf = torch.zeros(2, 2, 512, 64), torch.zeros(2, 2, 512, 64)
    kbuf[:, :, :300], vbuf[:, :, :300] = k, v
    kv, vv = kbuf[:, :, :300], vbuf[:, :, :300]
    assert not kv.is_contiguous()
    want = qkv.attention(q, k, v, backend="reference")
    torch.testing.assert_close(qkv.attention(q, kv, vv, backend="decode"), want)
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim strided
    torch.testing.assert_close(qkv.attention(q, kt, v, backend="decode"), want)


@needs_compiler
def test_unbatched_inputs_and_the_seed_shapes():
    """2-D ``[L, D]`` and 3-D ``[H, L, D]`` queries (the teaching text's shapes) keep their
    number of dims through the kernel."""
    q, k, v = torch.randn(1, 16), torch.randn(20, 16), torch.randn(20, 16)
    out = qkv.attention(q, k, v, backend="decode")
    assert out.shape == (1, 16)
    torch.testing.assert_close(out, torch.softmax(q @ k.T / 4, -1) @ v)
    q3, k3, v3 = torch.randn(4, 2, 16), torch.randn(4, 20, 16), torch.randn(4, 20, 16)
    assert qkv.attention(q3, k3, v3, backend="decode").shape == (4, 2, 16)


@needs_compiler
def test_who_takes_the_kernel():
    """auto takes it for a float32 CPU call with few rows per kv head and nothing to learn;
    everything else is planned elsewhere, with the reason."""
    q, k, v = make_qkv(Shape(1, 9, 3, 1, 100, 64), gen=4)
    plan = qkv.plan(q, k, v)
    assert plan.backend == "decode" and "decode kernel" in str(plan)
    assert "decode kernel computes this faster" in plan.rejected["sdpa"]

    def passed_over(**kw) -> str:
        """The auto plan does not take decode; naming it says why."""
        args = {"q": q, "k": k, "v": v, **kw}
        qq, kk, vv = args.pop("q"), args.pop("k"), args.pop("v")
        assert qkv.plan(qq, kk, vv, **args).backend != "decode"
        with pytest.raises(ValueError, match="backend 'decode' cannot compute") as e:
            qkv.plan(qq, kk, vv, backend="decode", **args)
        return str(e.value)

    assert "no backward" in passed_over(q=q.requires_grad_())
    q.requires_grad_(False)
    assert "float32" in passed_over(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16())
    rows = decode_mod.MAX_ROWS // 3 + 1
    long_q = torch.randn(1, 9, rows, 64)
    assert f"at most {decode_mod.MAX_ROWS} query rows" in passed_over(q=long_q)
    assert "score_mod" in passed_over(score_mod=qkv.softcap(5.0))
    assert "dropout" in passed_over(dropout_p=0.1)
    doc = qkv.document(torch.tensor([0] * 50 + [1] * 50))
    assert "contiguous run" in passed_over(q=torch.randn(1, 9, 1, 64), mask=doc)
    # under no_grad a call on learnable tensors takes it (generation in a training script)
    with torch.no_grad():
        assert qkv.plan(q.requires_grad_(), k, v).backend == "decode"


@needs_compiler
def test_repeat_calls_reuse_the_decision():
    """A decoder's repeat calls (no mask) keep the decode route under their signature and give the
    kernel's answer."""
    q, k, v = make_qkv(Shape(1, 9, 3, 1, 64, 64), gen=5)
    qkv._planning.kept.clear()
    first = qkv.attention(q, k, v)
    key = signature.of_call(q, k, v, None, None, False, "auto", qkv.planner.dense_limit())
    assert key is not None and key in qkv._planning.kept._KEPT
    assert qkv.plan(q, k, v).backend == "decode"
    torch.testing.assert_close(qkv.attention(q, k, v), first, rtol=0, atol=0)
    torch.testing.assert_close(first, qkv.attention(q, k, v, backend="reference"))


def test_qkv_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("QKV_NATIVE", "0")
    q, k, v = make_qkv(Shape(1, 9, 3, 1, 64, 64), gen=6)
    assert qkv.plan(q, k, v).backend == "sdpa"
    with pytest.raises(ValueError, match="QKV_NATIVE=0"):
        qkv.plan(q, k, v, backend="decode")


def test_a_failed_build_is_passed_over_with_the_reason(monkeypatch, caplog):
    """A build that fails at the first call (no compiler, no headers): that call and every
    later one are planned elsewhere, exact, with one logged line and the reason in the plan."""
    monkeypatch.setattr(decode_mod.LIBRARY, "_state", {})
    monkeypatch.setattr(qkv._planning.kept, "_KEPT", LRU(512))

    def broken():
        raise RuntimeError("c++: command not found\nmore detail")

    monkeypatch.setattr(decode_mod.LIBRARY, "_build", broken)
    monkeypatch.setattr(shutil, "which", lambda *_: "/usr/bin/c++")
    q, k, v = make_qkv(Shape(1, 9, 3, 1, 64, 64), gen=7)
    assert qkv.plan(q, k, v).backend == "decode"  # a dry run does not build
    with caplog.at_level(logging.WARNING, logger="qkv"):
        out = qkv.attention(q, k, v)
        qkv.attention(q, k, v)
    torch.testing.assert_close(out, qkv.attention(q, k, v, backend="reference"))
    logged = [r for r in caplog.records if "compiled kernel failed" in r.getMessage()]
    assert len(logged) == 1
    assert qkv.plan(q, k, v).backend == "sdpa"
    with pytest.raises(ValueError, match=re.escape("c++: command not found")):
        qkv.attention(q, k, v, backend="decode")


@needs_compiler
def test_a_key_limit_shared_by_the_batch():
    """A padding kind whose end is one int for every batch element (a cache's valid length)
    with per-batch starts: the shared end reaches the kernel as a [B] tensor."""
    from qkv._core.builtin_mods import (
        KvBelow,  # private: the kind qkv's caches build, not a public mask
    )

    q, k, v = make_qkv(Shape(3, 4, 2, 1, 60, 16), gen=8)
    mask = KvBelow(45, "keys 0..44 from start", start=torch.tensor([0, 10, 50]))
    assert qkv.plan(q, k, v, mask=mask).backend == "decode"
    out, lse = decode(q, k, v, mask=mask)
    want_out, want_lse = qkv.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    torch.testing.assert_close(out, want_out)
    assert torch.isneginf(lse[2]).all() and torch.isneginf(want_lse[2]).all()  # 50 > 44

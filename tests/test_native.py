"""qkv's compiled CPU band kernel (``src/qkv/backends/blocksparse/kernels/band.cpp``) against the
oracle, and the engine's fallback when it cannot be built.

The kernel is built on first use (~15-30 s once per machine, cached). Where a C++ compiler
exists (CI has one) these tests require it to build; without one they skip, and the rest of
the suite covers the fallback.
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import qkv
from catalogue import LAYOUTS, Shape, lay_out, make_qkv
from qkv._core.builtin_mods import Band
from qkv._door import validate
from qkv.backends.blocksparse import native as _native

# private: the compiled kernel's build, loading and the planner's choice of it are the units tested
from qkv.backends.blocksparse import plan as plan_mod
from qkv.backends.blocksparse.cost import weigh
from qkv.backends.blocksparse.grads import lse_hi_lo
from qkv_testing import assert_matches_oracle, compare_to_oracle

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None, reason="no C++ compiler to build qkv's CPU kernel"
)
with_lse = functools.partial(qkv.attention, backend="blocksparse", return_lse=True)


def _qkv(B, Hq, Hkv, Lq, Lk, D, Dv, seed=0):
    return make_qkv(Shape(B, Hq, Hkv, Lq, Lk, D, Dv), gen=seed)


def _job(q, k, v, mask, **kw):
    return plan_mod.make_job(qkv._door.validate(q, k, v, mask=mask, **kw))


@needs_compiler
def test_the_kernel_builds_and_the_engine_uses_it():
    assert _native.band_forward_op() is not None, _native.disabled()
    q, k, v = _qkv(1, 2, 2, 300, 300, 16, 16)
    mask = qkv.sliding_window(40)
    job = _job(q, k, v, mask)
    assert job.native_band == (-40, 0)
    assert not job.fwd.rows and not job.fwd.groups  # nothing planned for torch's kernel
    assert "compiled band kernel" in str(qkv.plan(q, k, v, mask=mask, backend="blocksparse"))


# (Lq, Lk), (D, Dv), heads, band (window, lookahead) as sliding_window takes them
SHAPES = [
    ((1, 1), (8, 8), (1, 1), (0, 0)),
    ((7, 7), (59, 59), (2, 2), (3, 0)),
    ((113, 113), (111, 111), (4, 4), (16, 0)),
    ((1025, 1025), (64, 64), (8, 2), (255, 0)),  # GQA, the benchmark's window
    ((1025, 113), (59, 111), (4, 1), (40, 60)),  # Lq > Lk, Dv != D, MQA, both sides
    ((113, 1025), (64, 32), (2, 2), (300, 200)),  # Lq < Lk
    ((257, 257), (128, 128), (2, 2), (31, 33)),  # blocks and chunks do not divide
    ((96, 96), (16, 16), (1, 1), (1000, 0)),  # wider than the sequence
    ((48, 48), (32, 64), (3, 1), (8, 3)),  # spans of <= 32 keys: small products, GQA, Dv != D
]


@needs_compiler
@pytest.mark.parametrize(("L", "dims", "heads", "band"), SHAPES, ids=str)
def test_band_kernel_matches_the_oracle(L, dims, heads, band):
    """Forward, lse and gradients (the backward recomputes from the kernel's lse with torch's
    kernel) against the float64 oracle, over odd shapes."""
    (Lq, Lk), (D, Dv), (Hq, Hkv) = L, dims, heads
    seed = zlib.crc32(repr((L, dims, heads, band)).encode())
    q, k, v = _qkv(2 if Lq < 500 else 1, Hq, Hkv, Lq, Lk, D, Dv, seed=seed)
    mask = qkv.sliding_window(*band)
    assert _job(q, k, v, mask).native_band is not None
    assert_matches_oracle(compare_to_oracle(with_lse, q, k, v, mask=mask))


@needs_compiler
@pytest.mark.parametrize(
    "mask",
    [
        qkv.sliding_window(0, 0),  # each row sees only its own key (rows past Lk see none)
        Band(50, 60, "keys 50-60 ahead"),  # past every key: no row sees anything
    ],
    ids=["diagonal", "empty"],
)
def test_rows_that_see_no_key(mask):
    """Rows whose band lies outside the keys get output 0 and lse -inf (the contract), and
    no NaN reaches any gradient."""
    q, k, v = _qkv(1, 2, 2, 70, 40, 16, 16, seed=3)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, lse = with_lse(q, k, v, mask=mask)
    want_out, want_lse = qkv.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    torch.testing.assert_close(out, want_out)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert _job(q, k, v, mask).native_band is not None
    assert torch.isneginf(lse[:, :, 40:]).all() and (out[:, :, 40:] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@needs_compiler
@pytest.mark.parametrize(("scale", "mult"), [(-0.3, 1.0), (1.0, 300.0)], ids=["negative", "1e3"])
def test_scale_and_extreme_logits(scale, mult):
    """A negative scale (the row max must be taken after scaling) and logits of ~1e3, with
    gradients (the engine redoes huge-lse problems with explicit matmuls for the backward)."""
    q, k, v = _qkv(1, 2, 2, 200, 200, 32, 32, seed=5)
    mask = qkv.sliding_window(50)
    assert_matches_oracle(compare_to_oracle(with_lse, q * mult, k, v, mask=mask, scale=scale))


@needs_compiler
def test_who_takes_the_kernel():
    """Only float32 CPU band masks with both edges take it; everything else keeps its plan."""
    q, k, v = _qkv(1, 2, 2, 64, 64, 16, 16)
    assert _job(q, k, v, qkv.sliding_window(8)).native_band is not None
    assert _job(q, k, v, qkv.causal).native_band is None  # one fused call (segments)
    assert _job(q, k, v, lambda b, h, i, j: (i - j).abs() < 4).native_band is None
    assert _job(q, k, v, qkv.sliding_window(8), score_mod=qkv.softcap(5.0)).native_band is None
    assert _job(q, k, v, qkv.sliding_window(8), dropout_p=0.1).native_band is None
    wide = qkv.sliding_window(plan_mod.NATIVE_MAX_WIDTH + 1)
    assert _job(q, k, v, wide).native_band is None
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    assert _job(qb, kb, vb, qkv.sliding_window(8)).native_band is None


def test_qkv_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("QKV_NATIVE", "0")
    q, k, v = _qkv(1, 2, 2, 300, 300, 16, 16)
    mask = qkv.sliding_window(40)
    assert _job(q, k, v, mask).native_band is None
    text = str(qkv.plan(q, k, v, mask=mask, backend="blocksparse"))
    assert "compiled band kernel" not in text
    assert "QKV_NATIVE=0" in plan_mod.native_band(qkv._door.validate(q, k, v, mask=mask))


def test_a_failed_build_falls_back_and_says_why(monkeypatch, caplog):
    """A machine whose build fails (no compiler, no headers) still gets exact results from
    torch's kernel, one logged line, and the reason from the planner."""
    monkeypatch.setattr(_native.LIBRARY, "_state", {})

    def broken():
        raise RuntimeError("c++: command not found\nmore detail")

    monkeypatch.setattr(_native.LIBRARY, "_build", broken)
    q, k, v = _qkv(1, 2, 2, 300, 300, 16, 16, seed=9)
    mask = qkv.sliding_window(40)
    with caplog.at_level(logging.WARNING, logger="qkv"):
        out = qkv.attention(q, k, v, mask=mask, backend="blocksparse")
        qkv.attention(q, k, v, mask=mask, backend="blocksparse")  # tries once, logs once
    torch.testing.assert_close(out, qkv.reference.attention(q, k, v, mask=mask)[0])
    logged = [r for r in caplog.records if "compiled kernel failed" in r.getMessage()]
    assert len(logged) == 1 and "c++: command not found" in logged[0].getMessage()
    why = plan_mod.native_band(qkv._door.validate(q, k, v, mask=mask))
    assert why is not None and "c++: command not found" in why
    assert _job(q, k, v, mask).fwd.groups  # torch's batched band tiles instead


@needs_compiler
def test_auto_sends_even_small_windows_to_the_kernel():
    """The compiled band kernel beats SDPA's dense call at every size measured, so auto takes
    it where it would otherwise send a small masked problem to SDPA."""
    q, k, v = _qkv(1, 4, 4, 64, 64, 16, 16)
    mask = qkv.sliding_window(16)
    plan = qkv.plan(q, k, v, mask=mask)
    assert plan.backend == "blocksparse" and "compiled band kernel" in str(plan)
    assert "sdpa" in plan.rejected and "band" in plan.rejected["sdpa"]
    torch.testing.assert_close(
        qkv.attention(q, k, v, mask=mask), qkv.reference.attention(q, k, v, mask=mask)[0]
    )
    # dropout and biases keep SDPA (the kernel computes neither)
    assert qkv.plan(q, k, v, mask=mask, dropout_p=0.1).backend == "sdpa"


@needs_compiler
@pytest.mark.parametrize(("heads", "band"), [((4, 4), (40, 0)), ((6, 2), (20, 30))], ids=str)
def test_backward_runs_in_the_kernel_with_gradients_through_lse(monkeypatch, heads, band):
    """The backward goes through the compiled kernel too (torch's band plan is never built),
    and a loss on both out and lse (dS gains dlse * P) matches the float64 oracle."""
    calls = []
    real = _native.band_backward

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(_native, "band_backward", counted)
    Hq, Hkv = heads
    q, k, v = _qkv(2, Hq, Hkv, 300, 280, 24, 40, seed=11)
    mask = qkv.sliding_window(*band)
    g = torch.Generator().manual_seed(12)
    w_out = torch.randn(2, Hq, 300, 40, generator=g)
    w_lse = torch.randn(2, Hq, 300, generator=g)

    def loss_grads(qq, kk, vv, backend):
        qq, kk, vv = (t.detach().requires_grad_() for t in (qq, kk, vv))
        out, lse = qkv.attention(qq, kk, vv, mask=mask, backend=backend, return_lse=True)
        loss = (out * w_out.to(out.dtype)).sum() + (lse * w_lse.to(lse.dtype)).sum()
        return torch.autograd.grad(loss, (qq, kk, vv))

    fast = loss_grads(q, k, v, "blocksparse")
    assert calls, "the compiled backward did not run"
    exact = loss_grads(q.double(), k.double(), v.double(), "reference")
    plain = loss_grads(q, k, v, "reference")  # float32, the same formula
    for f, e, p in zip(fast, exact, plain, strict=True):
        err, plain_err = (f.double() - e).abs().max(), (p.double() - e).abs().max()
        assert err <= 3 * plain_err + 1e-5, (float(err), float(plain_err))


# (B, Hq, Hkv, Lq, Lk, D, Dv): odd head dims, GQA, Lq != Lk both ways, one position
EXTRA_SHAPES = [
    (2, 4, 2, 113, 113, 59, 59),
    (3, 2, 2, 7, 29, 16, 16),
    (2, 2, 1, 37, 53, 111, 64),
    (1, 1, 1, 1, 1, 8, 8),
    (2, 3, 3, 48, 40, 32, 32),
]


def _extra_masks(B, Lq, Lk, gen):
    """Padding (batch 0 has no key at all: its rows see nothing), left padding, sorted and
    unsorted documents, and each with a band."""
    n = max(Lq, Lk)
    lengths = torch.randint(0, Lk + 1, (B,), generator=gen)
    lengths[0] = 0
    start = torch.randint(0, max(1, Lk // 3), (B,), generator=gen)
    ids = torch.randint(0, 4, (n,), generator=gen)
    return {
        "padding": qkv.padding(lengths),
        "left_padding": qkv.padding(torch.clamp(lengths, max=Lk // 2), start=start),
        "documents": qkv.document(torch.sort(ids).values),
        "unsorted_documents": qkv.document(ids),
        "causal_padding": qkv.and_masks(qkv.causal, qkv.padding(lengths)),
        "window_documents": qkv.and_masks(qkv.sliding_window(5), qkv.document(ids)),
    }


class _KernelWithExtras(torch.autograd.Function):
    """The band kernel's forward and backward with a mask's key ranges and document ids, as
    the engine would call them (the planner sends such masks to it only without gradients:
    its backward is tested here directly)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        p = qkv._door.validate(q, k, v, mask=mask, scale=scale)
        lo, hi = plan_mod.band_edges(p)
        more = _native.extras(p.mask.terms, p.B)
        out, lse = _native.band_forward(q, k, v, lo, hi, p.scale, more)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (lo, hi, p.scale, more)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        lo, hi, scale, more = ctx.meta
        lse_hi, lse_lo = lse_hi_lo(lse.double(), torch.float32)
        dq, dk, dv = _native.band_backward(
            q, k, v, out, dout, lse_hi, lse_lo, dlse, lo, hi, scale, more
        )
        return dq, dk, dv, None, None


@needs_compiler
@pytest.mark.parametrize("shape", EXTRA_SHAPES, ids=str)
def test_padding_and_documents_in_the_kernel_match_the_oracle(shape):
    """Small padding and document masks (alone and with a band) run in the band kernel when
    no gradient is needed: out and lse against the float64 oracle, every memory layout; the
    kernel's backward with the same key ranges and ids, gradients through lse included."""
    B, Hq, Hkv, Lq, Lk, D, Dv = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr(shape).encode()))
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, Dv, seed=gen)
    for i, (name, mask) in enumerate(_extra_masks(B, Lq, Lk, gen).items()):
        layout = LAYOUTS[(i + len(repr(shape))) % len(LAYOUTS)]
        ql, kl, vl = (lay_out(t, layout) for t in (q, k, v))
        assert _job(ql, kl, vl, mask).native_band is not None, name
        got = compare_to_oracle(with_lse, ql, kl, vl, mask=mask, grads=False)
        assert_matches_oracle(got)
        kernel = lambda q, k, v, mask, score_mod, scale: _KernelWithExtras.apply(  # noqa: E731
            q, k, v, mask, scale
        )
        assert_matches_oracle(compare_to_oracle(kernel, ql, kl, vl, mask=mask, seed=i))


@needs_compiler
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_long_padding_in_the_kernel_matches_the_oracle(layout):
    """Past 2^20 scores a padding mask (alone, left, or causal) still takes the kernel
    without gradients: out and lse against the float64 oracle at n = 1025, GQA."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = (lay_out(t, layout) for t in _qkv(2, 4, 2, 1025, 1025, 64, 64, seed=gen))
    lengths = torch.tensor([1025, 700])
    for mask in (
        qkv.padding(lengths),
        qkv.padding(torch.tensor([600, 0]), start=torch.tensor([300, 5])),
        qkv.and_masks(qkv.causal, qkv.padding(lengths)),
    ):
        assert _job(q, k, v, mask).native_band is not None
        assert_matches_oracle(compare_to_oracle(with_lse, q, k, v, mask=mask, grads=False))


@needs_compiler
@pytest.mark.parametrize("where", ["q", "k"])
def test_a_nan_in_padding_and_documents_reaches_the_rows_the_oracle_says(where):
    """A NaN query or key in the kernel's padding and document paths (sorted ids narrowed,
    unsorted compared): NaN exactly where the formula has it, the rest equal."""
    ids = torch.randint(0, 3, (48,), generator=torch.Generator().manual_seed(4))
    for mask in (
        qkv.padding(torch.tensor([30, 48])),
        qkv.document(torch.arange(48) // 16),
        qkv.document(ids),
    ):
        q, k, v = _qkv(2, 2, 2, 48, 48, 32, 32, seed=9)
        (q if where == "q" else k)[1, 0, 20, 3] = float("nan")
        assert _job(q, k, v, mask).native_band is not None
        got, want = (
            qkv.attention(q, k, v, mask=mask),
            qkv.reference.attention(q, k, v, mask=mask)[0],
        )
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want).any()
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num())


@needs_compiler
def test_padding_and_documents_take_the_kernel_without_gradients():
    """Auto sends a padding or a small document mask to the kernel (faster than SDPA on the
    dense mask and than the tile plans, measured), keeps SDPA where gradients are needed on
    so small a call (the engine's autograd costs more than SDPA's fused backward there), and
    past 2^20 scores takes for sorted documents whichever of mask-free calls per document and
    the kernel its cost estimates say is cheaper."""
    q, k, v = _qkv(4, 4, 4, 48, 48, 32, 32)
    for mask in (qkv.padding(torch.tensor([40, 48, 30, 0])), qkv.document(torch.arange(48) // 16)):
        plan = qkv.plan(q, k, v, mask=mask)
        assert plan.backend == "blocksparse" and "compiled band kernel" in str(plan), str(plan)
        torch.testing.assert_close(
            qkv.attention(q, k, v, mask=mask), qkv.reference.attention(q, k, v, mask=mask)[0]
        )
        qg = q.detach().requires_grad_()
        assert qkv.plan(qg, k, v, mask=mask).backend == "sdpa"
    big = _qkv(1, 8, 8, 512, 512, 16, 16)
    assert _job(*big, qkv.padding(torch.tensor([300]))).native_band == (-511, 511)
    for ids in (torch.arange(512) // 100, torch.arange(512) // 8):
        p = validate(*big, mask=qkv.document(ids))
        chosen = plan_mod.make_job(p)
        segments = plan_mod.Job(
            call=p, route="segments", fused=True, segments=tuple(plan_mod._segments(p))
        )
        band = plan_mod.Job(
            call=p, route="native_band", fused=True, native_band=(-511, 511), masked=True
        )
        costs = [
            weigh(p, job).blocksparse for job in (segments, band) if job.segments or job.native_band
        ]
        assert weigh(p, chosen).blocksparse == min(costs), (ids[-1], chosen.route, costs)


def test_the_build_stamp_reads_the_sources_not_where_the_checkout_lies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second clone of the same sources (CI's fresh clone, a worktree) loads the library
    the first one built: the stamp hashes the headers' contents, not their folder; a changed
    header changes it."""
    from qkv import native

    lib = _native.LIBRARY
    before = lib.stamp()
    other = tmp_path / "elsewhere" / "include"
    shutil.copytree(native._INCLUDE, other)
    monkeypatch.setattr(native, "_INCLUDE", other)
    assert any(f == f"-I{other}" for f in lib.flags())  # the compiler still gets the path
    assert lib.stamp() == before
    header = next(iter(sorted(other.glob("*.h"))))
    header.write_text(header.read_text() + "\n// changed\n")
    assert lib.stamp() != before


@needs_compiler
def test_a_built_kernel_loads_without_the_builder_in_a_new_process():
    """Once built, a new process loads the library directly (a stamp of source, flags and
    versions says it is current): no torch.utils.cpp_extension (~1 s, ~80 MiB of imports)
    and no torch._dynamo (which a decorator would import with qkv)."""
    assert _native.band_forward_op() is not None  # built (or loaded) in this process
    code = (
        "import sys, qkv\n"
        "from qkv.backends.blocksparse import native as _native\n"
        "assert _native.band_forward_op() is not None\n"
        "print(sorted(m for m in ('torch.utils.cpp_extension', 'torch._dynamo') "
        "if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout

"""The contract at its edges, on every backend: any memory layout, a zero or negative scale
with a causal mask, logits large enough to strain a recomputing backward, and the lse's dtype.
Each case here once gave a silent wrong answer somewhere (the layouts on the block-sparse
engine's fused kernel, ``is_causal`` with ``scale <= 0``, SDPA's backward at logits of 1e4);
the oracle matrix (test_backends.py) runs the layouts across its whole matrix too. NaN in the
input has its own file (test_nan.py)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import qkv
from catalogue import BACKENDS, LAYOUTS, Shape, lay_out, make_qkv
from qkv.backends import base
from qkv.backends.blocksparse import native as band_native
from qkv_testing import assert_matches_oracle, compare_to_oracle

# Shapes that reach each route: SDPA and the fused engine's mask-free segments (no mask,
# causal), the compiled band kernel (window), per-document segments and tiles (document),
# and the decode kernel (few query rows per kv head). D == Dv: no head-dim padding copy hides
# a layout from the fused kernel.
SHAPE = Shape(2, 4, 2, 113, 113, 59)
DECODE = Shape(2, 8, 2, 2, 300, 64)
DECODE_ROWS = Shape(2, 4, 4, 8, 300, 64)  # 8 query rows per kv head, still the decode kernel's
MASKS = {
    "none": lambda L: None,
    "causal": lambda L: qkv.causal,
    "window": lambda L: qkv.sliding_window(9),
    "document": lambda L: qkv.document(torch.arange(L) * 3 // L),
}


def _refusal(q, k, v, backend: str, **kw) -> str | None:
    if backend == "auto":
        return None
    try:
        qkv.plan(q, k, v, backend=backend, **kw)
    except ValueError as e:
        return str(e)
    return None


def _check(backend: str, q, k, v, *, grad_layout: str = "contiguous", **kw) -> bool:
    """Compare ``backend`` with the oracle (out, lse, gradients); False if it refuses."""
    want_lse = backend != "sdpa"
    if _refusal(q, k, v, backend, return_lse=want_lse, **kw) is not None:
        return False
    fn = functools.partial(qkv.attention, backend=backend, return_lse=want_lse)
    grads = backend != "decode"
    assert_matches_oracle(
        compare_to_oracle(fn, q, k, v, grads=grads, grad_layout=grad_layout, **kw)
    )
    return True


# ---------------------------------------------------------------------------- layouts


def test_a_transposed_value_tensor_with_lse():
    """The reported case: v stored transposed (stride(-1) == 64), auto with return_lse."""
    q, k = torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32)
    v = torch.randn(1, 2, 32, 64).mT
    assert v.stride(-1) == 64
    out, _ = qkv.attention(q, k, v, return_lse=True)
    ref, _ = qkv.reference.attention(q.double(), k.double(), v.double())
    assert (out.double() - ref).abs().max() < 1e-5


def _backend_mask_pairs() -> list[object]:
    """Every backend with every mask; Triton's kernels run in its interpreter here (seconds a
    case), so its default run reads every layout with the document mask (partial tiles) and
    the other masks are extended (make test-all)."""
    return [
        pytest.param(b, m, marks=[pytest.mark.extended])
        if b == "triton" and m != "document"
        else (b, m)
        for b in BACKENDS
        for m in MASKS
    ]


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x != "contiguous"])
@pytest.mark.parametrize(("backend", "mask"), _backend_mask_pairs())
def test_every_backend_reads_every_layout(backend: str, mask: str, layout: str):
    shape = DECODE if backend == "decode" else SHAPE
    q, k, v = (lay_out(t, layout) for t in make_qkv(shape, gen=hash((mask, layout)) % 1000))
    ran = _check(backend, q, k, v, mask=MASKS[mask](shape.Lk), grad_layout=layout)
    if backend in ("auto", "blocksparse", "reference"):
        assert ran, f"{backend} refused a plain problem"


@pytest.mark.parametrize("layout", ["transposed", "every_other"])
def test_layouts_on_torch_kernels(layout: str, torch_kernels: None):
    """Without qkv's compiled kernels (QKV_NATIVE=0), windows take batched band groups."""
    q, k, v = (lay_out(t, layout) for t in make_qkv(SHAPE.replace(Lq=300, Lk=300), gen=3))
    assert _check("blocksparse", q, k, v, mask=qkv.sliding_window(20), grad_layout=layout)


# ---------------------------------------------------------------------- scale <= 0


@pytest.mark.parametrize("scale", [0.0, -0.5, -1 / math.sqrt(59)])
@pytest.mark.parametrize("mask", ["causal", "prefix", "document_causal"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_and_negative_scales_equal_the_formula(backend: str, mask: str, scale: float):
    """torch's ``is_causal`` kernels give NaN for ``scale <= 0``; qkv must not."""
    shape = DECODE if backend == "decode" else SHAPE.replace(Lq=70, Lk=70)
    q, k, v = make_qkv(shape, gen=6)
    m = {
        "causal": qkv.causal,
        "prefix": qkv.prefix_lm(5),
        "document_causal": qkv.and_masks(
            qkv.causal, qkv.document(torch.arange(shape.Lk) * 2 // shape.Lk)
        ),
    }[mask]
    _check(backend, q, k, v, mask=m, scale=scale)


# -------------------------------------------------------------------- huge logits


@pytest.mark.parametrize("mask", [None, qkv.causal], ids=["none", "causal"])
@pytest.mark.parametrize("L", [64, 300])
def test_huge_logit_gradients_on_auto_are_as_exact_as_plain_autograd(L: int, mask):
    """Logits of ~1e4: SDPA's backward (a float32 lse, scores recomputed) lost up to 1e5x
    plain float32's error; auto must pick a backward that stays exact."""
    q, k, v = make_qkv(Shape(1, 2, 2, L, L, 32), gen=7)
    q, k = q * 100, k * 100
    plan = qkv.plan(q.requires_grad_(), k, v, mask=mask)
    assert plan.backend != "sdpa" and "logits may reach" in plan.rejected["sdpa"]
    named = qkv.plan(q, k, v, mask=mask, backend="sdpa")  # asked for: it runs, and says so
    assert any("logits may reach" in n for n in named.notes)
    assert_matches_oracle(compare_to_oracle(qkv.attention, q.detach(), k, v, mask=mask))


def test_a_kept_sdpa_decision_is_not_reused_for_huge_logits():
    """Repeat calls reuse a signature's plan (qkv.planner): a first call with ordinary
    logits keeps SDPA's; a later call of the same shapes with huge logits must not run it."""
    shape = Shape(1, 2, 2, 48, 48, 32)
    q, k, v = make_qkv(shape, gen=8, requires_grad=True)
    qkv.attention(q, k, v, mask=qkv.causal).sum().backward()  # keeps SDPA's runner
    q2, k2, v2 = make_qkv(shape, gen=9)
    q2, k2 = q2 * 100, k2 * 100
    assert_matches_oracle(compare_to_oracle(qkv.attention, q2, k2, v2, mask=qkv.causal))


# ------------------------------------------------------------------------- lse dtype


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str
)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "sdpa"])
def test_lse_is_float32_or_float64_for_float64_inputs(backend: str, dtype: torch.dtype):
    shape = DECODE if backend == "decode" else SHAPE.replace(Lq=30, Lk=40)
    q, k, v = make_qkv(shape, dtype=dtype, gen=10)
    if _refusal(q, k, v, backend, mask=qkv.causal, return_lse=True) is not None:
        pytest.skip(f"{backend} does not take {dtype}")
    _, lse = qkv.attention(q, k, v, mask=qkv.causal, return_lse=True, backend=backend)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


# ------------------------------------------------------------- the bound auto reads


def _plain_bound(q: torch.Tensor, k: torch.Tensor) -> float:
    """max over (b, query head h) of max_i |q[b, h, i]| * max_j |k[b, h // groups, j]|, in
    float64, one row at a time."""
    g = q.shape[1] // k.shape[1]
    best = 0.0
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            qn = max(float(row.double().norm()) for row in q[b, h])
            kn = max(float(row.double().norm()) for row in k[b, h // g])
            best = max(best, qn * kn)
    return best


_needs_band_library = pytest.mark.skipif(
    band_native.disabled() is not None, reason="no compiled kernels here"
)


@_needs_band_library
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str
)
def test_the_logit_bound_is_the_norm_product_on_every_layout(dtype, layout: str):
    """Auto reads ``logit_bound`` on every call that needs gradients; the compiled one (one
    call) and torch's operators (where the library is not built) both give the largest query
    norm times the largest key norm of its kv head, in any memory layout, with GQA and head
    dims no vector width divides."""
    assert band_native.LIBRARY.ops() is not None
    q, k, _ = make_qkv(Shape(2, 6, 2, 7, 13, 59), dtype=dtype, gen=11)
    # scales that make any other pairing of heads or batch rows give a larger bound
    q = q * torch.tensor([1.0, 6, 1, 1, 1, 1], dtype=dtype).view(1, 6, 1, 1)
    q = lay_out(q * torch.tensor([1.0, 5], dtype=dtype).view(2, 1, 1, 1), layout)
    k = k * torch.tensor([1.0, 3], dtype=dtype).view(1, 2, 1, 1)
    k = lay_out(k * torch.tensor([5.0, 1], dtype=dtype).view(2, 1, 1, 1), layout)
    want = _plain_bound(q, k) * 0.3
    native = base.logit_bound(q, k, -0.3)
    assert base._native_bound() is not None
    base._NATIVE.clear()
    try:
        with pytest.MonkeyPatch.context() as mp:  # as where the library is not built
            mp.setattr(band_native.LIBRARY, "ops_if_built", lambda: None)
            fallback = base.logit_bound(q, k, -0.3)
            assert base._native_bound() is None
    finally:
        base._NATIVE.clear()
    rel = 1e-6 if dtype in (torch.float32, torch.float64) else 1e-2  # (torch's half norms)
    assert native == pytest.approx(want, rel=1e-5), (native, want)
    assert fallback == pytest.approx(want, rel=rel), (fallback, want)


@_needs_band_library
@pytest.mark.parametrize(
    ("value", "want"), [(float("nan"), "nan"), (float("inf"), "inf"), (6e4, "finite")]
)
def test_the_logit_bound_says_nan_inf_and_no_half_overflow(value: float, want: str):
    """A NaN anywhere in q makes the bound NaN and an infinity makes it inf (auto then keeps
    away from SDPA's backward, as before); a float16 row whose squared norm passes float16's
    range still gets a finite bound (summed in float32)."""
    assert band_native.LIBRARY.ops() is not None
    q, k, _ = make_qkv(Shape(1, 2, 1, 5, 5, 16), dtype=torch.float16, gen=12)
    q[0, 1, 3, 2] = value
    got = base.logit_bound(q, k, 0.25)
    assert {"nan": math.isnan, "inf": math.isinf, "finite": math.isfinite}[want](got), got
    if want == "finite":
        assert got == pytest.approx(_plain_bound(q, k) * 0.25, rel=1e-3)
    empty = q[:, :, :0]
    assert base.logit_bound(empty, k, 0.25) == 0.0

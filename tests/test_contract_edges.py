"""The contract at its edges, on every backend: any memory layout, NaN in the input, a zero or
negative scale with a causal mask, logits large enough to strain a recomputing backward, and
the lse's dtype. Each case here once gave a silent wrong answer somewhere (the layouts on the
block-sparse engine's fused kernel, NaN rows on the compiled kernels, ``is_causal`` with
``scale <= 0``, SDPA's backward at logits of 1e4); the oracle matrix (test_backends.py) runs
the layouts across its whole matrix too.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import qkv
from catalogue import BACKENDS, LAYOUTS, Shape, lay_out, make_qkv
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


# ------------------------------------------------------------------------------ NaN

NAN_ROW = 5


def _with_nan(t: torch.Tensor, row: int) -> torch.Tensor:
    t = t.clone()
    t[:, 1, row, 3] = float("nan")
    return t


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_query_row_gives_a_nan_row(backend: str, mask: str):
    """The formula gives NaN in the row of a NaN query (output and lse) and nowhere else; no
    backend may turn it into the zeros of a fully masked row."""
    shape = DECODE_ROWS if backend == "decode" else SHAPE.replace(Lq=40, Lk=40)
    q, k, v = make_qkv(shape, gen=1)
    q = _with_nan(q, NAN_ROW).requires_grad_()
    m = MASKS[mask](shape.Lk)
    lse_ok = backend != "sdpa"
    if _refusal(q, k, v, backend, mask=m, return_lse=lse_ok) is not None:
        pytest.skip(f"{backend} does not take this problem")
    res = qkv.attention(q, k, v, mask=m, backend=backend, return_lse=lse_ok)
    out, lse = res if lse_ok else (res, None)
    assert torch.isnan(out[:, 1, NAN_ROW]).all(), f"{backend}: the NaN row came out as numbers"
    others = torch.ones(out.shape[:3], dtype=torch.bool)
    others[:, 1, NAN_ROW] = False
    assert not torch.isnan(out[others]).any(), f"{backend}: NaN spread to other query rows"
    if lse is not None:
        assert torch.isnan(lse[:, 1, NAN_ROW]).all(), f"{backend}: lse of the NaN row is {lse}"
    if backend != "decode":
        out.sum().backward()
        assert torch.isnan(q.grad[:, 1, NAN_ROW]).all(), "the NaN did not reach dq"


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_key_or_value_reaches_every_row_that_sees_it(backend: str, mask: str, where: str):
    shape = DECODE_ROWS if backend == "decode" else SHAPE.replace(Lq=40, Lk=40)
    q, k, v = make_qkv(shape, gen=2)
    j = 3  # every row from 3 on sees key 3 (causal), rows 3..12 under the window of 9
    if where == "k":
        k = _with_nan(k, j)
    else:
        v = _with_nan(v, j)
    m = MASKS[mask](shape.Lk)
    if _refusal(q, k, v, backend, mask=m) is not None:
        pytest.skip(f"{backend} does not take this problem")
    out = qkv.attention(q, k, v, mask=m, backend=backend)
    _, w = qkv.reference.attention(q.double(), k.nan_to_num().double(), v.double(), mask=m)
    g = shape.Hq // shape.Hkv
    sees = w[:, g : 2 * g, :, j] > 0  # [B, g, Lq]: the query heads of kv head 1 that see j
    assert sees.any()
    # a NaN key makes the row's scores NaN; a NaN value element, that column of the output
    got = out[:, g : 2 * g][sees] if where == "k" else out[:, g : 2 * g][sees][:, 3]
    assert torch.isnan(got).all(), f"{backend}: a NaN vanished"


def test_inspect_weights_keep_a_nan_row():
    q, k, v = make_qkv(SHAPE.replace(Lq=20, Lk=30), gen=4)
    q = _with_nan(q, NAN_ROW)
    _, lse = qkv.attention(q, k, v, return_lse=True)
    w = qkv.inspect.weights(q, k, lse=lse)
    assert torch.isnan(w[:, 1, NAN_ROW]).all()
    rows = w.sum(-1)
    rows[:, 1, NAN_ROW] = 1.0
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5)


def test_the_reference_keeps_nan_apart_from_fully_masked_rows():
    q, k, v = make_qkv(SHAPE.replace(Lq=6, Lk=6), gen=5)
    q = _with_nan(q, 2)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[4] = False  # row 4 sees nothing: 0 and -inf, as the contract says
    p = qkv._core.problem.validate(q, k, v, mask=mask)
    out, lse, _ = qkv.reference.forward(p, dropout_p=0.0)
    assert torch.isnan(out[:, 1, 2]).all() and torch.isnan(lse[:, 1, 2]).all()
    assert (out[:, :, 4] == 0).all() and torch.isneginf(lse[:, :, 4]).all()


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


def test_inspect_stats_keep_a_nan_row():
    q, k, v = make_qkv(SHAPE.replace(Lq=20, Lk=30), gen=11)
    q = _with_nan(q, NAN_ROW)
    _, lse = qkv.attention(q, k, v, return_lse=True)
    st = qkv.inspect.stats(q, k, lse=lse, top_k=3)
    assert torch.isnan(st.entropy[:, 1, NAN_ROW]).all()
    assert torch.isnan(st.top_weights[:, 1, NAN_ROW]).all()
    fine = torch.ones(st.entropy.shape, dtype=torch.bool)
    fine[:, 1, NAN_ROW] = False
    assert torch.isfinite(st.entropy[fine]).all() and (st.top_keys[fine] >= 0).all()

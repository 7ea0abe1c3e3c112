"""``backend="triton"`` beyond the oracle matrix.

test_backends.py runs the catalogue's masks, score mods, shapes and dtypes through it (in
Triton's interpreter on machines without a GPU: conftest sets ``TRITON_INTERPRET=1``). Here:
many tiles per row and different forward / backward tilings (the block lists and their
transpose), a block mask reused and cut finer, gradients through the lse, strided inputs,
float16 and head dim 256, empty problems, what ``qkv.plan`` says, refusals, and that ``auto``
never takes the interpreter. The CUDA suite (``pytest -m cuda``) runs the same checks at GPU
sizes and the routing of ``auto`` on a GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch

import qkv
from catalogue import Shape, make_mask, make_qkv, make_score
from conftest import cuda
from qkv_testing import assert_matches_oracle, compare_to_oracle

pytest.importorskip("triton")

import qkv.backends.triton as triton_backend
from qkv.backends.triton.launch import Tiling, Tilings

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton = functools.partial(qkv.attention, backend="triton", return_lse=True)

# Lengths no tile size divides, GQA, Dv != D; small enough for the interpreter.
MANY = Shape(2, 4, 2, 100, 140, 16, 24)


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 16 x 32 forward, 32 x 64 for dK/dV and 32 x 32 for dQ: many blocks per row
    in short sequences, and three tilings, each with its own lists."""
    monkeypatch.setattr(
        triton_backend,
        "tilings",
        lambda p, spec: Tilings(
            fwd=Tiling(16, 32, 4, 2), dkdv=Tiling(32, 64, 4, 2), dq=Tiling(32, 32, 4, 2)
        ),
    )


MASKS = [
    "causal",
    "window2",
    "document_unsorted",
    "padding",
    "prefix_lm",
    "and",
    "or_mod",
    "bool",
    "dilated",
    "head_dependent",
    "dead_rows",
]


# In the default run: a band, unsorted documents (partial tiles everywhere), a bool tensor and
# rows with no key; the others are extended (make test-all): each costs seconds in the
# interpreter.
DEFAULT_RUN = {"window2", "document_unsorted", "bool", "dead_rows"}


@pytest.mark.parametrize(
    "mask", [m if m in DEFAULT_RUN else pytest.param(m, marks=pytest.mark.extended) for m in MASKS]
)
def test_many_tiles_and_separate_backward_lists(small_tiles: None, mask: str) -> None:
    q, k, v = make_qkv(MANY, gen=3, device=DEVICE)
    m = make_mask(mask, MANY, 4, device=DEVICE)
    assert_matches_oracle(compare_to_oracle(triton, q, k, v, mask=m))


# In the default run: the relative table (a gather per head and a gradient into the table);
# every score kind also runs on small shapes in test_backends.py's oracle matrix.
@pytest.mark.parametrize(
    "name",
    [
        n if n == "relative" else pytest.param(n, marks=pytest.mark.extended)
        for n in ("alibi", "relative", "softcap", "bias")
    ],
)
def test_score_mods_with_many_tiles(small_tiles: None, name: str) -> None:
    q, k, v = make_qkv(MANY, gen=5, device=DEVICE)
    sm, params = make_score(name, MANY, 6, device=DEVICE)
    m = make_mask("window2", MANY, 7, device=DEVICE)
    assert_matches_oracle(
        compare_to_oracle(triton, q, k, v, mask=m, score_mod=sm, extra_params=params)
    )


def test_block_mask_reused_and_cut_finer(small_tiles: None) -> None:
    """A block mask planned at 64 x 64 runs at the kernel's finer tiling without evaluating
    its mask_mod again, and its lists are made once for every later call."""
    shape = MANY.replace(B=1)
    q, k, v = make_qkv(shape, gen=8, device=DEVICE)
    calls = []

    def striped(b, h, q_idx, kv_idx):
        calls.append(1)
        return ((q_idx // 8 + kv_idx // 8) % 2 == 0) | (kv_idx == 0)

    bm = qkv.block_mask(striped, None, None, shape.Lq, shape.Lk, block_size=64, device=DEVICE)
    planned = len(calls)
    assert_matches_oracle(compare_to_oracle(triton, q, k, v, mask=bm))
    after_first = len(calls)
    lists = [v for key, v in bm.schedules.items() if key[0] == "triton-refined"]
    assert len(lists) == 3, bm.schedules.keys()  # the forward's, dK/dV's and dQ's tilings
    out_again = triton(q, k, v, mask=bm)[0]
    assert len(calls) == after_first, "the second call evaluated the mask_mod again"
    assert after_first > planned  # the partial tiles' bits were evaluated (once)
    torch.testing.assert_close(out_again, triton(q, k, v, mask=striped)[0])


def test_gradient_through_the_lse() -> None:
    shape = MANY.replace(B=1, Lq=37, Lk=50)
    for mask in ("causal", "dead_rows"):
        q, k, v = make_qkv(shape, gen=9, requires_grad=True, device=DEVICE)
        m = make_mask(mask, shape, 10, device=DEVICE)
        gen = torch.Generator().manual_seed(11)
        wo = torch.randn(shape.B, shape.Hq, shape.Lq, shape.Dv, generator=gen).to(DEVICE)
        wl = torch.randn(shape.B, shape.Hq, shape.Lq, generator=gen).to(DEVICE)

        def loss(out, lse, wo=wo, wl=wl):
            return (out * wo).sum() + (torch.where(torch.isfinite(lse), lse, 0) * wl).sum()

        got = torch.autograd.grad(loss(*triton(q, k, v, mask=m)), (q, k, v))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = qkv.attention(q64, k64, v64, mask=m, backend="reference", return_lse=True)
        want = torch.autograd.grad(loss(ref[0], ref[1].double()), (q64, k64, v64))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=1e-4)


def test_strided_inputs() -> None:
    """transformers' [B, L, H, D] projections seen as [B, H, L, D], and a head dim read with
    a stride (copied once, as the kernel reads the head dim contiguously)."""
    B, L, H, D = 2, 45, 4, 32
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(B, L, H, 2 * D, generator=gen).to(DEVICE)
    q = x[..., :D].transpose(1, 2)  # [B, H, L, D], strided
    k = x[..., D:].transpose(1, 2)
    v = x[..., ::2].transpose(1, 2)  # the head dim with stride 2
    assert v.stride(-1) == 2
    assert_matches_oracle(compare_to_oracle(triton, q, k, v, mask=qkv.sliding_window(6)))


@pytest.mark.parametrize(
    "shape,dtype",
    [
        (Shape(1, 2, 1, 40, 33, 256), torch.float32),
        (Shape(2, 4, 2, 37, 29, 59), torch.float16),
        (Shape(1, 2, 2, 7, 113, 111), torch.float16),
    ],
    ids=str,
)
def test_float16_and_head_dim_256(shape: Shape, dtype: torch.dtype) -> None:
    q, k, v = make_qkv(shape, dtype=dtype, gen=13, device=DEVICE)
    for mask in (None, qkv.causal, make_mask("padding", shape, 14, device=DEVICE)):
        assert_matches_oracle(compare_to_oracle(triton, q, k, v, mask=mask))


def test_empty_problems() -> None:
    q, k, v = make_qkv(Shape(2, 2, 1, 5, 0, 16), requires_grad=True, device=DEVICE)
    out, lse = triton(q, k, v)
    assert out.shape == (2, 2, 5, 16) and bool((out == 0).all())
    assert bool((lse == float("-inf")).all())
    out.sum().backward()  # no key: zero gradients, as for any row that sees none
    assert q.grad is not None and bool((q.grad == 0).all())
    q, k, v = make_qkv(Shape(2, 2, 1, 0, 9, 16), device=DEVICE)
    out, lse = triton(q, k, v, mask=qkv.causal)
    assert out.shape == (2, 2, 0, 16) and lse.shape == (2, 2, 0)


def test_plan_says_what_runs() -> None:
    q, k, v = make_qkv(Shape(1, 2, 2, 300, 300, 64), device=DEVICE)
    plan = qkv.plan(q, k, v, mask=qkv.sliding_window(40), backend="triton")
    assert plan.backend == "triton"
    assert "mask in the kernel: band -40 <= kv - q <= 0" in plan.forward
    assert "dK/dV per" in plan.backward
    assert plan.route.block is not None and plan.route.block.num_blocks["empty"] > 0
    ids = torch.arange(300, device=DEVICE) // 100
    plan = qkv.plan(q, k, v, mask=qkv.and_masks(qkv.causal, qkv.document(ids)), backend="triton")
    assert "ids[q] == ids[kv]" in plan.forward and "band" in plan.forward
    plan = qkv.plan(
        q, k, v, mask=make_mask("dilated", Shape(1, 2, 2, 300, 300, 64)), backend="triton"
    )
    assert "precomputed bits" in plan.forward
    assert any("packed bits" in n for n in plan.route_notes)


@pytest.mark.parametrize(
    "kw,why",
    [
        ({"dropout_p": 0.1}, "no dropout"),
        ({"score_mod": lambda s, b, h, q, k: s * 2}, "Python score_mod"),
    ],
)
def test_refusals_name_the_reason(kw: dict, why: str) -> None:
    q, k, v = make_qkv(Shape(1, 2, 2, 16, 16, 16), device=DEVICE)
    with pytest.raises(ValueError, match=why):
        qkv.attention(q, k, v, backend="triton", **kw)
    q, k, v = make_qkv(Shape(1, 2, 2, 16, 16, 16), dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
        qkv.attention(q, k, v, backend="triton")
    q, k, v = make_qkv(Shape(1, 1, 1, 4, 4, 264), device=DEVICE)
    with pytest.raises(ValueError, match="head dims up to 256"):
        qkv.attention(q, k, v, backend="triton")


def test_auto_never_takes_the_interpreter() -> None:
    q, k, v = make_qkv(Shape(1, 2, 2, 2048, 2048, 32))
    plan = qkv.plan(q, k, v, mask=qkv.sliding_window(64), return_lse=True)
    assert plan.backend == "blocksparse"
    assert "triton" in plan.rejected


# ------------------------------------------------------------------------------ CUDA


@cuda
@pytest.mark.parametrize("mask", ["causal", "window", "document", "padding", "and", "dilated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_gpu_sizes(mask: str, dtype: torch.dtype) -> None:
    shape = Shape(2, 8, 2, 1500, 1700, 128)
    q, k, v = make_qkv(shape, dtype=dtype, gen=15, device="cuda")
    m = make_mask(mask, shape, 16, device="cuda")
    sm, params = make_score("alibi", shape, 17, device="cuda")
    assert_matches_oracle(
        compare_to_oracle(triton, q, k, v, mask=m, score_mod=sm, extra_params=params)
    )


@cuda
def test_cuda_long_window_bf16() -> None:
    shape = Shape(1, 4, 4, 8192, 8192, 64)
    q, k, v = make_qkv(shape, dtype=torch.bfloat16, gen=18, device="cuda")
    out = triton(q, k, v, mask=qkv.sliding_window(1024))[0]
    ref = qkv.attention(q.float(), k.float(), v.float(), mask=qkv.sliding_window(1024))
    assert (out.float() - ref).abs().max() < 2e-2


@cuda
def test_cuda_auto_routes() -> None:
    q, k, v = make_qkv(Shape(1, 16, 16, 8192, 8192, 128), dtype=torch.bfloat16, device="cuda")
    assert qkv.plan(q, k, v).backend == "sdpa"
    assert qkv.plan(q, k, v, mask=qkv.causal).backend == "sdpa"
    assert qkv.plan(q, k, v, mask=qkv.sliding_window(1024)).backend == "triton"
    assert qkv.plan(q, k, v, mask=qkv.causal, return_lse=True).backend == "triton"
    ids = torch.arange(8192, device="cuda") // 1024
    doc = qkv.and_masks(qkv.causal, qkv.document(ids))
    assert qkv.plan(q, k, v, mask=doc).backend == "triton"


def test_a_mask_is_planned_once_until_its_tensors_change(monkeypatch) -> None:
    """A padding mask passed to every layer, or made anew in each (an equal value), is planned
    once (kept under its value); an in-place change of its lengths is seen (the value's key
    holds the tensors' versions)."""
    from qkv.backends.triton import lists

    built = []
    real = lists.build
    monkeypatch.setattr(lists, "build", lambda *a, **kw: built.append(1) or real(*a, **kw))
    shape = Shape(2, 2, 2, 40, 50, 16)
    q, k, v = make_qkv(shape, gen=19, device=DEVICE)
    lengths = torch.tensor([50, 20])
    mask = qkv.padding(lengths)
    first = triton(q, k, v, mask=mask)[0]
    assert len(built) == 1
    again = triton(q, k, v, mask=mask)[0]
    inline = triton(q, k, v, mask=qkv.padding(lengths))[0]
    assert len(built) == 1, "an equal mask was planned again"
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(inline, first, rtol=0, atol=0)
    lengths[1] = 45  # the user edits the lengths in place: more key blocks are visible
    changed = triton(q, k, v, mask=mask)[0]
    assert len(built) == 2
    want = qkv.attention(q, k, v, mask=qkv.padding(torch.tensor([50, 45])), backend="reference")
    torch.testing.assert_close(changed, want, atol=1e-5, rtol=1e-5)

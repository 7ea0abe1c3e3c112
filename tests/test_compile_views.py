"""Compiled training as models write it: q, k, v as views of one projection.

nanoGPT splits one fused projection ``c_attn(x)`` into q, k, v and views each as ``[B, H, L,
D]`` by ``.view(B, L, H, D).transpose(1, 2)``: three non-contiguous views of one storage, which
alias each other. Hugging Face models project separately and transpose ``[B, L, H, D]``; a
teaching text passes one tensor as q, k and v. Whatever route a call takes under
``torch.compile`` (SDPA traced in, the engine's operators, the band kernel's operators), its
forward and backward must trace and equal eager's, above and below every size at which the
route changes: ``SMALL_DENSE`` (2^20 scores: SDPA with a dense mask below, the engine above)
and the band kernel's own cut-overs. The window's compiled backward once chose its kernel
with a ``torch.cond``, whose branches refuse inputs that alias each other: nanoGPT's views
crashed the first backward above 2^20 scores.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch._dynamo

import qkv

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-inductor-"))

Tensor = torch.Tensor

# (B, H, L): below and above SMALL_DENSE = 2^20 scores (B*H*L*L)
SIZES = {"small": (2, 4, 64), "large": (8, 4, 256)}
D = 16


def _ids(B: int, L: int) -> Tensor:
    return torch.arange(L) * 3 // L  # three packed documents


def _masks(B: int, L: int) -> dict[str, dict]:
    ids = _ids(B, L)
    lengths = torch.tensor([L - 5, L // 2, L, 7][:B] * (B // 4 + 1))[:B]
    return {
        "none": {},
        "causal": {"mask": qkv.causal},
        "window": {"mask": qkv.sliding_window(16)},
        "document": {"mask": qkv.document(ids)},
        "padding": {"mask": qkv.padding(lengths)},
        "prefix_lm": {"mask": qkv.prefix_lm(L // 5)},
        "causal_document": {"mask": qkv.and_masks(qkv.causal, qkv.document(ids))},
        "window_document": {"mask": qkv.and_masks(qkv.sliding_window(16), qkv.document(ids))},
        "mask_mod": {"mask": lambda b, h, qi, ki: (qi >= ki) & ((qi - ki) % 3 != 1)},
        "alibi": {"mask": qkv.causal, "score_mod": qkv.alibi(qkv.alibi_slopes(4))},
        "softcap": {"mask": qkv.sliding_window(16), "score_mod": qkv.softcap(20.0)},
        "score_mod": {"mask": qkv.causal, "score_mod": lambda s, b, h, qi, ki: s - 0.1 * h},
    }


def _project(ys: list[Tensor], layout: str, H: int, Hkv: int) -> tuple[Tensor, ...]:
    """q, k, v from projections ``ys`` (``[B, L, C]`` each) as a model lays them out."""
    B, L, _ = ys[0].shape
    if layout == "same":  # one tensor as q, k and v
        t = ys[0].view(B, L, H, D).transpose(1, 2)  # [B, H, L, D]
        return t, t, t
    if layout == "nanogpt":  # one fused projection, split and viewed
        q, k, v = ys[0].split([H * D, Hkv * D, Hkv * D], dim=2)
    else:  # Hugging Face: separate projections, each [B, L, H, D] transposed
        q, k, v = ys
    q = q.view(B, L, H, D).transpose(1, 2)  # [B, H, L, D]
    k = k.view(B, L, Hkv, D).transpose(1, 2)  # [B, Hkv, L, D]
    v = v.view(B, L, Hkv, D).transpose(1, 2)  # [B, Hkv, L, D]
    return q, k, v


def _model(ys: list[Tensor], layout: str, H: int, Hkv: int, kw: dict) -> Tensor:
    q, k, v = _project(ys, layout, H, Hkv)
    return qkv.attention(q, k, v, **kw)


def _run(fn, ys: list[Tensor], layout: str, H: int, Hkv: int, kw: dict, autocast: bool):
    """Output and gradients for the projections (the leaves: per-element gradients, no
    reduction after attention's own that would add rounding of its own)."""
    leaves = [y.detach().requires_grad_() for y in ys]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn([y.to(torch.bfloat16) if autocast else y for y in leaves], layout, H, Hkv, kw)
    up = torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype)
    return [out.float(), *torch.autograd.grad(out, leaves, up)]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _check(mask: str, size: str, layout: str, *, gqa=False, autocast=False, backend="aot_eager"):
    B, H, L = SIZES[size]
    Hkv = 2 if gqa else H
    gen = torch.Generator().manual_seed(sum(map(ord, mask + size + layout)))
    widths = {"nanogpt": [(H + 2 * Hkv) * D], "same": [H * D], "hf": [H * D, Hkv * D, Hkv * D]}
    ys = [torch.randn(B, L, c, generator=gen) for c in widths[layout]]
    kw = _masks(B, L)[mask]
    compiled = torch.compile(_model, backend=backend, fullgraph=True)
    got = _run(compiled, ys, layout, H, Hkv, kw, autocast)
    want = _run(_model, ys, layout, H, Hkv, kw, autocast)
    # (bfloat16: a compiled graph may round its intermediates at other places than eager)
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"output {i}: {m}")


_EVERY = list(_masks(2, 64))
_DEFAULT = {"window", "causal", "document", "causal_document", "mask_mod", "score_mod"}
_SMALL = {"window", "mask_mod"}  # (below 2^20 scores the others trace SDPA or the formula)


@pytest.mark.parametrize(
    ("mask", "size"),
    [
        (m, size)
        if m in _DEFAULT and (size == "large" or m in _SMALL)
        else pytest.param(m, size, marks=pytest.mark.extended)
        for m in _EVERY
        for size in SIZES
    ],
)
def test_nanogpt_views_train_compiled_as_eager(mask: str, size: str):
    """Every mask and score, q, k, v as nanoGPT's views of one projection, above and below
    2^20 scores: the compiled forward and backward trace whole and equal eager's."""
    _check(mask, size, "nanogpt")


@pytest.mark.parametrize("layout", ["hf", "same"])
@pytest.mark.parametrize("mask", ["window", "document", "mask_mod"])
def test_other_model_layouts_train_compiled_as_eager(mask: str, layout: str):
    """Hugging Face's transposed projections, and one tensor as q, k and v (inputs that are
    the same tensor alias each other too)."""
    _check(mask, "large", layout)


@pytest.mark.parametrize("mask", ["window", "causal", "padding"])
def test_grouped_query_views_train_compiled_as_eager(mask: str):
    _check(mask, "large", "nanogpt", gqa=True)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("mask", ["window", "causal_document"])
def test_bfloat16_autocast_trains_compiled_as_eager(mask: str, size: str):
    """Under ``torch.autocast`` the projection yields bfloat16 views: the same routes in
    bfloat16 (no band kernel: it computes float32)."""
    _check(mask, size, "nanogpt", autocast=True)


@pytest.mark.parametrize(
    "mask", ["window", pytest.param("causal_document", marks=pytest.mark.extended)]
)
def test_inductor_trains_nanogpt_views_as_eager(mask: str):
    """The crash as users met it: inductor, a window, nanoGPT's views, above 2^20 scores."""
    _check(mask, "large", "nanogpt", backend="inductor")

"""qkv.scaled_dot_product_attention against torch's function, and qkv.override_sdpa.

Every case compares with ``torch.nn.functional.scaled_dot_product_attention`` (torch 2.13)
on the same inputs, outputs and gradients. In float32/float64 both must agree within the
dtype's usual tolerance; in half precision qkv's error against a float64 run of torch's
function must stay within 2x (outputs) / 3x (gradients) of torch's own error (STYLE 4).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv import _sdpa_masks, sdpa_override
from qkv.torch_sdpa import SDPATypeError, SDPAValueError, plan

Tensor = torch.Tensor
TORCH_SDPA: Callable[..., Tensor] = F.scaled_dot_product_attention
SDPA: Callable[..., Tensor] = qkv.scaled_dot_product_attention
_TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _leaves(*ts: Tensor | None) -> list[Tensor]:
    return [t for t in ts if t is not None and t.requires_grad]


def _run(
    fn: Callable[..., Tensor], args: tuple[Any, ...], kw: dict[str, Any], g: Tensor
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Output and gradients of fn (w.r.t. every input that requires grad) for upstream ``g``."""
    out = fn(*args, **kw)
    leaves = _leaves(*args, kw.get("attn_mask"))
    grads = torch.autograd.grad(out, leaves, g, allow_unused=True) if leaves else ()
    return out, grads


def _assert_same(args: tuple[Tensor, ...], **kw: Any) -> None:
    """qkv's function equals torch's on ``args``/``kw``: outputs and gradients."""
    dtype = args[0].dtype
    torch.manual_seed(1)
    ref = TORCH_SDPA(*args, **kw)
    g = torch.randn_like(ref)
    want, want_g = _run(TORCH_SDPA, args, kw, g)
    got, got_g = _run(qkv.scaled_dot_product_attention, args, kw, g)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any()
    if dtype in _TOL:
        tol = _TOL[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        for a, b in zip(got_g, want_g, strict=True):
            torch.testing.assert_close(a, b, atol=10 * tol, rtol=10 * tol)
        return
    # Half precision: errors against torch's function in float64, within a factor of torch's.
    hi = tuple(t.detach().double().requires_grad_(t.requires_grad) for t in args)
    kw64 = dict(kw)
    m = kw.get("attn_mask")
    if m is not None and m.is_floating_point():
        kw64["attn_mask"] = m.detach().double().requires_grad_(m.requires_grad)
    exact, exact_g = _run(TORCH_SDPA, hi, kw64, g.double())
    floor = 1e-3 if dtype == torch.float16 else 8e-3

    def err(a: Tensor, b: Tensor) -> float:
        return float((a.detach().double() - b.detach()).abs().max())

    assert err(got, exact) <= 2 * err(want, exact) + floor
    for a, b, e in zip(got_g, want_g, exact_g, strict=True):
        assert err(a, e) <= 3 * err(b, e) + floor * float(e.abs().max().clamp(min=1))


def _qkv(
    lead: tuple[int, ...],
    hq: int,
    hk: int,
    lq: int,
    lk: int,
    d: int,
    dtype: torch.dtype,
    grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    def t(h: int, n: int) -> Tensor:
        shape = (*lead, h, n, d) if h else (*lead, n, d)
        return torch.randn(shape, dtype=dtype).requires_grad_(grad)

    return t(hq, lq), t(hk, lk), t(hk, lk)


# --- the grid: masks x GQA x scale x dtypes x leading dims --------------------------------

MASKS = ["none", "bool", "float", "broadcast", "causal", "bool+causal", "float+causal", "band"]


def _mask(
    kind: str, lead: tuple[int, ...], hq: int, lq: int, lk: int, dtype: torch.dtype
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    full = (*lead, hq, lq, lk) if hq else (lq, lk)
    if kind == "none":
        return {}
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bool":
        return {"attn_mask": torch.rand(full, generator=gen) > 0.3}
    if kind == "float":
        bias = torch.randn(full, generator=gen).to(dtype)
        return {"attn_mask": bias.requires_grad_()}
    if kind == "broadcast":  # one row of keys for every query and head: [1, Lk]
        return {"attn_mask": torch.rand(1, lk, generator=gen) > 0.4}
    if kind == "band":
        return {"attn_mask": torch.ones(lq, lk, dtype=torch.bool).tril(1).triu(-2)}
    base = _mask(kind.split("+")[0], lead, hq, lq, lk, dtype)
    return {**base, "is_causal": True}


GRID = [
    # lead, Hq, Hkv, Lq, Lk, D, gqa
    ((2,), 4, 4, 7, 7, 16, False),
    ((2,), 4, 2, 5, 9, 8, True),  # GQA, Lq < Lk
    ((3,), 2, 1, 9, 5, 8, False),  # MQA by broadcasting, Lq > Lk
    ((), 2, 2, 6, 6, 8, False),  # 3-D: [H, L, D]
    ((2, 3), 2, 2, 5, 6, 8, False),  # two leading dims
    ((), 0, 0, 5, 7, 8, False),  # 2-D: [L, D]
    ((2,), 1, 3, 4, 6, 8, False),  # one query head broadcast against 3 kv heads
]


def _torch_takes(q: Tensor, k: Tensor, v: Tensor, kw: dict[str, Any]) -> bool:
    try:
        TORCH_SDPA(q, k, v, **kw)
    except RuntimeError as e:
        assert "Explicit attn_mask should not be set" in str(e)
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GRID, ids=lambda s: f"lead{s[0]}-h{s[1]}/{s[2]}-L{s[3]}x{s[4]}")
@pytest.mark.parametrize("mask", MASKS)
def test_matches_torch(mask: str, shape: tuple, dtype: torch.dtype) -> None:
    lead, hq, hk, lq, lk, d, gqa = shape
    q, k, v = _qkv(lead, hq, hk, lq, lk, d, dtype)
    kw = _mask(mask, lead, hq, lq, lk, dtype)
    if gqa:
        kw["enable_gqa"] = True
    if "attn_mask" in kw and kw.get("is_causal") and not _torch_takes(q, k, v, kw):
        # torch's math kernel refuses a mask beside is_causal (see test_mask_beside_causal)
        with pytest.raises(SDPAValueError, match="Explicit attn_mask"):
            qkv.scaled_dot_product_attention(q, k, v, **kw)
        return
    _assert_same((q, k, v), **kw)


@pytest.mark.parametrize("scale", [0.3, -1.0, 0.0])
def test_scale_matches_torch(scale: float) -> None:
    q, k, v = _qkv((2,), 3, 3, 6, 8, 16, torch.float64)
    _assert_same((q, k, v), scale=scale, attn_mask=torch.rand(6, 8) > 0.3)


def test_layouts_and_value_dim() -> None:
    """Transposed, expanded and offset views, and Dv != D, give torch's answer."""
    x = torch.randn(2, 9, 3, 40, dtype=torch.float64)  # [B, L, H, 40]
    q = x[..., :16].transpose(1, 2).requires_grad_(False)  # [B, H, L, 16] strided
    k = torch.randn(1, 3, 11, 16, dtype=torch.float64).expand(2, 3, 11, 16)
    v = torch.randn(2, 11, 3, 24, dtype=torch.float64).transpose(1, 2)  # [B, H, Lk, 24]
    _assert_same((q, k, v), attn_mask=torch.rand(9, 11) > 0.5)


# --- torch 2.13's CPU behaviour where the contract is delicate ------------------------------


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero_like_torch(kind: str) -> None:
    q, k, v = _qkv((1,), 2, 2, 4, 6, 8, torch.float32)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[1] = False
    m = keep if kind == "bool" else torch.zeros(4, 6).masked_fill(~keep, float("-inf"))
    out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.equal(TORCH_SDPA(q, k, v, attn_mask=m)[:, :, 1], out[:, :, 1])  # torch: 0 too
    out.sum().backward()
    assert q.grad is not None and torch.equal(q.grad[:, :, 1], torch.zeros(1, 2, 8))
    assert not any(t.grad.isnan().any() for t in (q, k, v) if t.grad is not None)


def test_nan_query_reaches_its_row() -> None:
    """qkv's contract, stronger than torch's fused CPU kernel (which returns 0 for this row)."""
    q, k, v = _qkv((1,), 1, 1, 4, 6, 8, torch.float32, grad=False)
    q[0, 0, 2, 0] = float("nan")
    out = qkv.scaled_dot_product_attention(q, k, v)
    assert out[0, 0, 2].isnan().all() and not out[0, 0, [0, 1, 3]].isnan().any()


def test_mask_beside_causal() -> None:
    """torch 2.13 on the CPU: 4-D inputs without dropout keep the keys both allow (its fused
    kernel); its math kernel (3-D inputs, dropout, Dv != D, flash off) raises."""
    q, k, v = _qkv((1,), 2, 2, 5, 5, 8, torch.float32, grad=False)
    m = torch.rand(5, 5) > 0.3
    both = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)
    tri = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(both, TORCH_SDPA(q, k, v, attn_mask=m & tri))
    cases: list[tuple[tuple[Tensor, ...], dict[str, Any]]] = [
        ((q[0], k[0], v[0]), {}),
        ((q, k, v), {"dropout_p": 0.5}),
        ((q, k, v[..., :4]), {}),
        ((q, k[:, :1], v[:, :1]), {}),  # one kv head broadcast without enable_gqa
    ]
    for args, kw in cases:
        with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set"):
            TORCH_SDPA(*args, attn_mask=m, is_causal=True, **kw)
        with pytest.raises(SDPAValueError, match="Explicit attn_mask should not be set"):
            SDPA(*args, attn_mask=m, is_causal=True, **kw)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]), pytest.raises(RuntimeError, match="Explicit attn_mask"):
        qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)


def test_dropout() -> None:
    """Dropout as torch's: always applied when p > 0, rescaled by 1/(1-p); p = 1 gives 0."""
    q, k = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    v = torch.ones(1, 2, 64, 8)
    out = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    # each output element is sum(kept probs) / 0.5 with v = 1: mean 1, not all 1
    assert abs(float(out.mean()) - 1.0) < 0.1 and not torch.allclose(out, torch.ones_like(out))
    torch.manual_seed(3)
    a = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    b = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert torch.equal(
        qkv.scaled_dot_product_attention(q, k, v, dropout_p=1.0), torch.zeros_like(v)
    )


@pytest.mark.parametrize(
    ("call", "err", "text"),
    [
        (lambda q: (q, q.half(), q.half()), SDPATypeError, "one dtype"),
        (lambda q: (q.long(), q.long(), q.long()), SDPATypeError, "must be float16"),
        (lambda q: (q[0, 0, 0], q, q), SDPAValueError, "at least 2 dims"),
        (lambda q: (q, q[..., :4], q), SDPAValueError, "same head dim"),
        (lambda q: (q, q[:, :3], q[:, :3]), SDPAValueError, "enable_gqa=True"),
        (lambda q: (q, q[:, :2], q[:, :3]), SDPAValueError, "equal or 1"),
    ],
)
def test_bad_input_raises_like_torch(call: Callable, err: type, text: str) -> None:
    args = call(torch.randn(2, 4, 5, 8))
    with pytest.raises(RuntimeError):  # torch raises RuntimeError for each of these
        TORCH_SDPA(*args)
    with pytest.raises(err, match=text):
        qkv.scaled_dot_product_attention(*args)


def test_bad_options_name_the_fix() -> None:
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(SDPAValueError, match="enable_gqa=True"):
        qkv.scaled_dot_product_attention(q, k, k)
    with pytest.raises(SDPAValueError, match="must divide"):
        qkv.scaled_dot_product_attention(
            q, k[:, :1].repeat(1, 3, 1, 1), k[:, :1].repeat(1, 3, 1, 1), enable_gqa=True
        )
    with pytest.raises(SDPAValueError, match=r"does not broadcast.*\(1, 4, 5, 5\)"):
        qkv.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(SDPATypeError, match=r"attn_mask has dtype torch\.int64"):
        qkv.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.long))
    with pytest.raises(SDPAValueError, match="between 0 and 1"):
        qkv.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(SDPAValueError, match="same Lk"):  # (torch computes something here)
        qkv.scaled_dot_product_attention(q, q, q[:, :, :3])
    with pytest.raises(SDPATypeError, match="is_causal must be a bool"):
        qkv.scaled_dot_product_attention(q, q, q, is_causal=1)  # type: ignore[arg-type]


# --- recognised masks go to the block-sparse engine ----------------------------------------

N = 320  # 320 * 320 scores: above _sdpa_masks.MIN_POSITIONS


def _tri(n: int = N) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.mark.parametrize(
    ("mask", "shown"),
    [
        (lambda: _tri(), "causal"),
        (lambda: _tri().triu(-63), "sliding_window(63)"),
        (lambda: torch.ones(N, N, dtype=torch.bool).tril(8).triu(-8), "sliding_window(8, 8)"),
        (lambda: torch.zeros(N, N).masked_fill(~_tri(), float("-inf")), "causal"),
        (
            lambda: (
                torch.arange(N).expand(2, 1, 1, N) < torch.tensor([100, 250])[:, None, None, None]
            ),
            "padding",
        ),
        (
            lambda: (
                torch.arange(N).expand(2, 1, 1, N) >= torch.tensor([30, 0])[:, None, None, None]
            ),
            "padding",
        ),
    ],
    ids=["causal", "window", "symmetric", "float-causal", "key-padding", "left-padding"],
)
def test_recognised_masks(mask: Callable[[], Tensor], shown: str) -> None:
    m = mask()
    q, k, v = _qkv((2,), 2, 2, N, N, 16, torch.float32)
    p = plan(q, k, v, attn_mask=m)
    assert shown in str(p).split("mask    :")[1].splitlines()[0], str(p)
    assert "tensor" not in str(p).split("mask    :")[1].splitlines()[0]
    _assert_same((q, k, v), attn_mask=m)


@pytest.mark.parametrize(
    "mask",
    [
        lambda: torch.ones(N, N, dtype=torch.bool).tril(-1),  # off the diagonal: row 0 empty
        lambda: _tri() ^ torch.eye(N, dtype=torch.bool).roll(5, 1).tril(),  # causal with holes
        lambda: torch.rand(2, 1, 1, N) > 0.5,  # key mask that is not a prefix
        lambda: torch.zeros(N, N).masked_fill(~_tri(), -1e4),  # a finite bias stays a bias
    ],
    ids=["off-diagonal", "holes", "scattered-keys", "finite-bias"],
)
def test_unrecognised_masks_stay_tensors(mask: Callable[[], Tensor]) -> None:
    m = mask()
    q, k, v = _qkv((2,), 2, 2, N, N, 16, torch.float32)
    assert "tensor" in str(plan(q, k, v, attn_mask=m))
    _assert_same((q, k, v), attn_mask=m)


def test_recognition_sees_in_place_edits() -> None:
    """A mask read once and then edited in place is read again (fails if the kept answer
    ignored the tensor's version)."""
    m = _tri()
    q, k, v = _qkv((1,), 2, 2, N, N, 16, torch.float32, grad=False)
    qkv.scaled_dot_product_attention(q, k, v, attn_mask=m)
    m[N // 2, :] = False  # no longer causal: that row is fully masked
    torch.testing.assert_close(
        qkv.scaled_dot_product_attention(q, k, v, attn_mask=m), TORCH_SDPA(q, k, v, attn_mask=m)
    )


def test_small_problems_are_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def spy(m: Tensor, batch: int) -> Any:
        seen.append(1)
        return _sdpa_masks._UNKNOWN

    monkeypatch.setattr(_sdpa_masks, "_from_bool", spy)
    q = torch.randn(1, 2, 64, 8)
    qkv.scaled_dot_product_attention(q, q, q, attn_mask=_tri(64))
    assert seen == []
    q = torch.randn(1, 2, N, 8)
    qkv.scaled_dot_product_attention(q, q, q, attn_mask=_tri())
    assert seen == [1]


# --- override_sdpa --------------------------------------------------------------------------


@pytest.fixture
def qkv_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The query shapes of the calls that reached qkv's function through the override."""
    calls: list[tuple[int, ...]] = []
    real = sdpa_override.scaled_dot_product_attention

    def counting(q: Tensor, *a: Any, **kw: Any) -> Tensor:
        calls.append(tuple(q.shape))
        return real(q, *a, **kw)

    monkeypatch.setattr(sdpa_override, "scaled_dot_product_attention", counting)
    return calls


def test_override_restores_and_nests(qkv_calls: list) -> None:
    q = torch.randn(1, 2, 5, 8)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with qkv.override_sdpa():
        with qkv.override_sdpa():
            F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q)  # the outer one is still open
        assert len(qkv_calls) == 2
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert torch.backends.mha.get_fastpath_enabled()
    with pytest.raises(KeyError), qkv.override_sdpa():
        raise KeyError("x")
    assert F.scaled_dot_product_attention is TORCH_SDPA
    F.scaled_dot_product_attention(q, q, q)
    assert len(qkv_calls) == 2


def test_override_keeps_an_earlier_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another library's patch of F.scaled_dot_product_attention serves the calls outside the
    override and is put back after it (fails if torch's function were restored instead)."""
    seen: list[int] = []

    def patched(*a: Any, **kw: Any) -> Tensor:
        seen.append(1)
        return TORCH_SDPA(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", patched)
    q = torch.randn(1, 2, 5, 8)
    with qkv.override_sdpa():
        F.scaled_dot_product_attention(q, q, q)
    assert seen == [] and F.scaled_dot_product_attention is patched


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_refused() -> None:
    nt = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)])
    with pytest.raises(SDPATypeError, match="nested tensor"):
        qkv.scaled_dot_product_attention(nt, nt, nt)


def test_override_as_decorator(qkv_calls: list) -> None:
    @qkv.override_sdpa
    def bare(x: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(x, x, x)

    @qkv.override_sdpa()
    def called(x: Tensor, depth: int) -> Tensor:  # recursive: the same object re-entered
        return called(x, depth - 1) if depth else F.scaled_dot_product_attention(x, x, x)

    q = torch.randn(1, 2, 5, 8)
    bare(q)
    called(q, 3)
    assert len(qkv_calls) == 2 and bare.__name__ == "bare"
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with pytest.raises(TypeError, match="a function to decorate"):
        qkv.override_sdpa(3)  # type: ignore[call-overload]


def test_override_is_per_thread(qkv_calls: list) -> None:
    """Another thread's calls keep torch's function while this one's override is open."""
    q = torch.randn(1, 2, 5, 8)
    inside, go = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        F.scaled_dot_product_attention(q[:, :1], q[:, :1], q[:, :1])  # [1, 1, 5, 8]
        go.set()

    t = threading.Thread(target=other)
    t.start()
    with qkv.override_sdpa():
        inside.set()
        go.wait(30)
        F.scaled_dot_product_attention(q, q, q)
    t.join()
    assert qkv_calls == [(1, 2, 5, 8)]


def test_override_under_compile(qkv_calls: list) -> None:
    """A function compiled inside the block traces qkv's function; called again outside it
    runs torch's (dynamo guards on the function and the thread's count)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")

    def f(x: Tensor, m: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(x, x, x, attn_mask=m)

    cf = torch.compile(f, backend=cnt, fullgraph=True)
    x, m = torch.randn(1, 2, 6, 8), torch.rand(6, 6) > 0.3
    with qkv.override_sdpa():
        torch.testing.assert_close(cf(x, m), TORCH_SDPA(x, x, x, attn_mask=m))
    assert len(qkv_calls) == 1  # traced once
    torch.testing.assert_close(cf(x, m), TORCH_SDPA(x, x, x, attn_mask=m))
    assert cnt.frame_count == 2 and len(qkv_calls) == 1  # recompiled to torch's


# --- models: the same outputs and gradients with and without the override --------------------


class NanoGPTBlock(nn.Module):
    """nanoGPT's CausalSelfAttention + MLP (karpathy/nanoGPT model.py), flash branch."""

    def __init__(self, d: int = 48, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.n_head = heads

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln2(x))


class ViTBlock(nn.Module):
    """timm's vision_transformer Attention (fused_attn branch) + MLP, without timm."""

    def __init__(self, d: int = 48, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv_ = self.qkv(self.norm1(x)).reshape(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv_.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [B, H, N, hd]
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(B, N, C))  # [B, N, C]
        return x + self.mlp(self.norm2(x))


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(48, 4, 96, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _decoder() -> nn.Module:
    layer = nn.TransformerDecoderLayer(48, 4, 96, dropout=0.0, batch_first=True)
    return nn.TransformerDecoder(layer, 2)


def _inputs(name: str) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
    x = torch.randn(2, 12, 48)
    if name == "encoder":
        pad = torch.arange(12)[None] >= torch.tensor([[12], [7]])  # True = padding (torch's)
        return (x,), {"src_key_padding_mask": pad}
    if name == "decoder":
        mask = nn.Transformer.generate_square_subsequent_mask(12)
        return (x, torch.randn(2, 9, 48)), {"tgt_mask": mask, "tgt_is_causal": True}
    if name == "mha":
        return (x, x, x), {"attn_mask": torch.rand(12, 12) > 0.2, "need_weights": False}
    return (x,), {}


MODELS: dict[str, Callable[[], nn.Module]] = {
    "nanogpt": NanoGPTBlock,
    "vit": ViTBlock,
    "encoder": _encoder,
    "decoder": _decoder,
    "mha": lambda: nn.MultiheadAttention(48, 4, batch_first=True),
}
LAYERS = {"nanogpt": 1, "vit": 1, "encoder": 2, "decoder": 4, "mha": 1}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(MODELS))
def test_models_same_under_override(name: str, train: bool, qkv_calls: list) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().train(train)
    args, kw = _inputs(name)

    def step() -> tuple[Tensor, list[Tensor]]:
        model.zero_grad()
        out = model(*args, **kw)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want, want_g = step()
    with qkv.override_sdpa():
        got, got_g = step()
    assert len(qkv_calls) == LAYERS[name]
    valid = ~kw["src_key_padding_mask"][..., None] if name == "encoder" else True
    torch.testing.assert_close(got * valid, want * valid, atol=2e-5, rtol=2e-5)
    assert len(got_g) == len(want_g)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_eval_fast_path_goes_through_qkv(qkv_calls: list) -> None:
    """nn.TransformerEncoder in eval under no_grad takes a fused C++ fast path that never calls
    the Python function; the override turns it off, so qkv sees every layer."""
    model = _encoder().eval()
    x = torch.randn(2, 12, 48)
    with torch.no_grad():
        want = model(x)
        with qkv.override_sdpa():
            got = model(x)
    assert len(qkv_calls) == 2
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_record_names_calls_by_module() -> None:
    model = _encoder().eval()
    with qkv.override_sdpa(), qkv.inspect.record(model) as rec:
        model(torch.randn(1, 10, 48))
    assert rec.layers == ["layers.0.self_attn", "layers.1.self_attn"]
    w = rec["layers.1.self_attn"].weights(rows=[3])  # [1, H, 1, 10]
    assert w.shape == (1, 4, 1, 10)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 1))


def test_transformers_sdpa_model() -> None:
    """A transformers Llama on attn_implementation='sdpa', unedited, runs on qkv."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 64, (2, 11))
    attn = torch.ones(2, 11, dtype=torch.long)
    attn[1, :3] = 0  # left padding
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attn).logits
        with qkv.override_sdpa(), qkv.inspect.record(model) as rec:
            got = model(input_ids=ids, attention_mask=attn).logits
    assert rec.layers == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], atol=1e-5, rtol=1e-5)


# --- qkv explain --torch-model --------------------------------------------------------------

_FACTORY = """
import torch
from torch import nn


def encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    return model, {"src": torch.randn(1, 6, 32), "mask": ~mask}


def not_a_model():
    return 3
"""


def test_explain_torch_model(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from qkv.cli import main

    (tmp_path / "mymodels.py").write_text(_FACTORY)
    monkeypatch.chdir(tmp_path)
    assert main(["explain", "--torch-model", "mymodels:encoder", "--token", "#2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "mymodels:encoder: 2 attention calls on qkv"
    for line, layer in zip(out[1:], ["layers.0.self_attn", "layers.1.self_attn"], strict=True):
        assert layer in line and "q [1, 4, 6, 8]" in line and "row 2 ->" in line
        keys = [int(kp.split(":")[0]) for kp in line.split("-> ")[1].split(", ")]
        assert len(keys) == 3 and max(keys) <= 2  # a causal mask: row 2 sees keys 0..2 only
    for spec, text in [
        ("mymodels:not_a_model", "must return (model, inputs)"),
        ("mymodels", "give module:factory"),
        ("nosuchmodule:f", "cannot import"),
    ]:
        assert main(["explain", "--torch-model", spec]) == 2
        assert text in capsys.readouterr().err

"""qkv.MultiHeadAttention: the oracle, torch's module, GQA, grads, state_dict, compile, errors."""

from __future__ import annotations

import io

import pytest
import torch

import qkv
from mha_testing import plain_mha

Tensor = torch.Tensor


def _err(a: Tensor, b: Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _assert_matches_plain(mha: qkv.MultiHeadAttention, x_q, x_kv=None, **kw) -> None:
    """Module output and every parameter's gradient (random upstream grad) vs the float64
    plain module: error within 2x (out) / 3x (grads) of plain float32's, plus a floor."""
    names = [n for n, _ in mha.named_parameters()]
    p64 = {n: t.detach().double().requires_grad_() for n, t in mha.named_parameters()}
    p32 = {n: t.detach().clone().requires_grad_() for n, t in mha.named_parameters()}
    mha.zero_grad()
    out = mha(x_q, x_kv, **kw)
    o64, _ = plain_mha(mha, x_q, x_kv, params=p64, **kw)
    o32, _ = plain_mha(mha, x_q, x_kv, params=p32, dtype=torch.float32, **kw)
    assert _err(out, o64) <= 2 * _err(o32, o64) + 1e-6, (_err(out, o64), _err(o32, o64))
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(do.float())
    g64 = torch.autograd.grad(o64, [p64[n] for n in names], do)
    g32 = torch.autograd.grad(o32, [p32[n] for n in names], do.float())
    params = dict(mha.named_parameters())
    for n, a64, a32 in zip(names, g64, g32, strict=True):
        g = params[n].grad
        assert g is not None, f"no gradient reached {n}"
        assert float(g.abs().max()) > 0, f"zero gradient for {n}"
        assert _err(g, a64) <= 3 * _err(a32, a64) + 1e-5, (n, _err(g, a64), _err(a32, a64))


# --------------------------------------------------------------------------- against the oracle


@pytest.mark.parametrize(
    "cfg",
    [
        dict(d_model=48, n_heads=4),
        dict(d_model=48, n_heads=4, bias=True),
        dict(d_model=48, n_heads=6, n_kv_heads=2, bias=True, qk_norm=True),
        dict(d_model=64, n_heads=4, n_kv_heads=1, rope=True),
        dict(d_model=96, n_heads=2, rope=qkv.RotaryEmbedding(16, base=500.0), qk_norm=True),
    ],
    ids=["plain", "bias", "gqa-qknorm", "mqa-rope", "partial-rope"],
)
@pytest.mark.parametrize("mask", [None, qkv.causal], ids=["nomask", "causal"])
def test_self_attention_matches_plain_module(cfg, mask):
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(**cfg)
    x = torch.randn(2, 13, cfg["d_model"])
    _assert_matches_plain(mha, x, mask=mask)


@pytest.mark.parametrize(
    ("d_model", "n_heads", "n_kv_heads", "lq", "lk"),
    [(118, 2, 1, 7, 113), (111, 1, 1, 113, 1), (222, 2, 2, 1, 7), (118, 2, 2, 1025, 33)],
)
def test_odd_shapes_cross_attention_match_plain_module(d_model, n_heads, n_kv_heads, lq, lk):
    """Head dims 59/111, lengths 1/7/113/1025, Lq != Lk, GQA/MQA."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(d_model, n_heads, n_kv_heads=n_kv_heads, bias=True)
    x, ctx = torch.randn(2, lq, d_model), torch.randn(2, lk, d_model)
    _assert_matches_plain(mha, x, ctx)
    _assert_matches_plain(mha, x, ctx, mask=qkv.padding(torch.tensor([lk, 0])))  # all masked


def test_cross_attention_kdim_gqa_matches_plain_module():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, n_kv_heads=2, kdim=20, vdim=20, bias=True)
    x, ctx = torch.randn(3, 7, 32), torch.randn(3, 11, 20)
    lengths = torch.tensor([11, 4, 1])
    _assert_matches_plain(mha, x, ctx, mask=qkv.padding(lengths))


def test_need_weights_match_oracle_and_sum_to_one():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, n_kv_heads=2)
    x, ctx = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
    kpm = torch.tensor([[True] * 9, [True] * 3 + [False] * 6])[:, None, None, :]
    out, w = mha(x, ctx, mask=kpm, need_weights=True)
    o64, w64 = plain_mha(mha, x, ctx, mask=kpm)
    assert w.shape == (2, 4, 5, 9)
    assert _err(out, o64) < 1e-5 and _err(w, w64) < 1e-6
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 5))
    assert float(w[1, :, :, 3:].detach().abs().max()) == 0.0
    assert torch.equal(out, mha(x, ctx, mask=kpm)) or _err(out, mha(x, ctx, mask=kpm)) < 1e-6


def test_fully_masked_rows_give_bias_only_output():
    """A query row with no visible key attends to nothing: attention output 0, so the module
    output is out_proj's bias, and gradients stay finite."""
    mha = qkv.MultiHeadAttention(16, 2, bias=True)
    x = torch.randn(1, 4, 16, requires_grad=True)
    mask = torch.tensor([True, False, True, True])[None, None, :, None].expand(1, 1, 4, 4)
    out, w = mha(x, mask=mask, need_weights=True)
    assert (
        torch.equal(out[0, 1], mha.out_proj.bias.detach().expand(16))
        or _err(out[0, 1], mha.out_proj.bias) < 1e-7
    )
    assert float(w[0, :, 1].detach().abs().max()) == 0.0
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    ("mask", "score_mod"),
    [
        (None, None),
        (qkv.causal, qkv.alibi(qkv.alibi_slopes(6))),
        (qkv.sliding_window(5), None),
        (qkv.padding(torch.tensor([37, 0])), None),  # the second batch element: all masked
    ],
    ids=["nomask", "causal-alibi", "window", "all-masked"],
)
def test_need_weights_and_their_gradients_match_plain_module(mask, score_mod):
    """The weights are rebuilt from the lse of the qkv.attention call: weights and output vs
    the float64 plain module within 2x of plain float32's error, and the gradients of both
    (random upstream grads) into every parameter within 3x."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(48, 6, n_kv_heads=2, bias=True, rope=True)
    x = torch.randn(2, 37, 48)
    names = [n for n, _ in mha.named_parameters()]
    p64 = {n: t.detach().double().requires_grad_() for n, t in mha.named_parameters()}
    p32 = {n: t.detach().clone().requires_grad_() for n, t in mha.named_parameters()}
    kw = dict(mask=mask, score_mod=score_mod)
    out, w = mha(x, need_weights=True, **kw)
    o64, w64 = plain_mha(mha, x, params=p64, **kw)
    o32, w32 = plain_mha(mha, x, params=p32, dtype=torch.float32, **kw)
    assert w.shape == (2, 6, 37, 37) and w.dtype == torch.float32
    assert _err(out, o64) <= 2 * _err(o32, o64) + 1e-6, (_err(out, o64), _err(o32, o64))
    assert _err(w, w64) <= 2 * _err(w32, w64) + 1e-7, (_err(w, w64), _err(w32, w64))
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dw = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    torch.autograd.backward((out, w), (do.float(), dw.float()))
    g64 = torch.autograd.grad((o64, w64), [p64[n] for n in names], (do, dw))
    g32 = torch.autograd.grad((o32, w32), [p32[n] for n in names], (do.float(), dw.float()))
    params = dict(mha.named_parameters())
    for n, a64, a32 in zip(names, g64, g32, strict=True):
        g = params[n].grad
        assert g is not None and float(g.abs().max()) > 0, f"no gradient reached {n}"
        assert _err(g, a64) <= 3 * _err(a32, a64) + 1e-5, (n, _err(g, a64), _err(a32, a64))


def test_record_sees_need_weights_calls():
    """need_weights=True runs qkv.attention (with return_lse=True), so qkv.inspect.record
    captures the call, and the capture's weights are the ones the module returned."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, n_kv_heads=2, rope=True)
    x = torch.randn(2, 11, 32)
    mask = qkv.and_masks(qkv.causal, qkv.padding(torch.tensor([11, 7])))
    with qkv.inspect.record(mha) as rec:
        out, w = mha(x, mask=mask, need_weights=True)
        plain_out = mha(x, mask=mask)
    assert [c.layer for c in rec] == ["", ""]  # the recorded module itself
    cap = rec[0]
    assert cap.q is not None and cap.q.shape == (2, 4, 11, 8)
    assert cap.k is not None and cap.k.shape == (2, 2, 11, 8)
    assert _err(cap.weights(), w) <= 1e-7
    assert _err(cap.weights(rows=[10], heads=[1]), w[:, 1:2, 10:11]) <= 1e-7
    assert _err(out, plain_out) < 1e-6
    o64, w64 = plain_mha(mha, x, mask=mask)
    assert _err(w, w64) < 1e-6 and _err(out, o64) < 1e-5
    # Inside a model, the call is named by the layer that made it.
    model = torch.nn.ModuleDict({"attn": mha})
    with qkv.inspect.record(model) as rec:
        _, w_again = model["attn"](x, mask=mask, need_weights=True)
    assert rec.layers == ["attn"] and torch.equal(w_again, w)


# ---------------------------------------------------------------- the module's own behaviour


def test_one_module_does_self_and_cross_attention():
    """Multi-head attention is how, not between what: x_kv=None is self-attention, a context
    is cross-attention, and self-attention is cross-attention with the input as context."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4)
    x, ctx = torch.randn(2, 6, 32), torch.randn(2, 9, 32)
    assert torch.equal(mha(x), mha(x, x))
    assert mha(x, ctx).shape == (2, 6, 32)
    o64, _ = plain_mha(mha, x, ctx)
    assert _err(mha(x, ctx), o64) < 1e-5
    assert _err(mha(x, ctx), mha(x)) > 1e-3  # the context matters


def test_unbatched_input():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, n_kv_heads=2, rope=True)
    x, ctx = torch.randn(6, 32), torch.randn(9, 32)
    out, w = mha(x, ctx, need_weights=True)
    assert out.shape == (6, 32) and w.shape == (4, 6, 9)
    ob, wb = mha(x[None], ctx[None], need_weights=True)
    assert torch.equal(out, ob[0]) and torch.equal(w, wb[0])
    assert torch.equal(mha(x, mask=qkv.causal), mha(x[None], mask=qkv.causal)[0])


def test_gqa_equals_mha_with_repeated_kv_weights():
    torch.manual_seed(0)
    H, Hkv, D, d = 8, 2, 6, 48
    gqa = qkv.MultiHeadAttention(d, H, n_kv_heads=Hkv, bias=True, rope=True)
    mha = qkv.MultiHeadAttention(d, H, bias=True, rope=True)
    g = H // Hkv
    with torch.no_grad():
        for name in ("q_proj", "out_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            w = src.weight.view(Hkv, D, d).repeat_interleave(g, dim=0)  # [H, D, d]
            dst.weight.copy_(w.reshape(H * D, d))
            dst.bias.copy_(src.bias.view(Hkv, D).repeat_interleave(g, dim=0).reshape(H * D))
    x = torch.randn(2, 11, d)
    for mask in (None, qkv.causal):
        assert _err(gqa(x, mask=mask), mha(x, mask=mask)) < 1e-6
    assert gqa.k_proj.weight.shape == (Hkv * D, d)


def test_mask_mod_and_score_mod_pass_through():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4)
    x = torch.randn(1, 10, 32)
    sm = qkv.alibi(qkv.alibi_slopes(4))
    mask = qkv.and_masks(qkv.causal, lambda b, h, q, k: (q - k) < 4)
    out = mha(x, mask=mask, score_mod=sm)
    o64, _ = plain_mha(mha, x, mask=mask, score_mod=sm)
    assert _err(out, o64) < 1e-5
    bias = torch.randn(4, 10, 10)
    assert _err(mha(x, score_mod=bias), plain_mha(mha, x, score_mod=bias.double())[0]) < 1e-5


def test_dropout_only_in_training():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, dropout=0.5)
    ref = qkv.MultiHeadAttention(32, 4)
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(2, 8, 32)
    mha.eval()
    assert torch.equal(mha(x), ref(x))
    mha.train()
    torch.manual_seed(1)
    a = mha(x)
    torch.manual_seed(1)
    a_w, w = mha(x, need_weights=True)
    assert _err(a, ref(x)) > 1e-3  # dropout acted
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 8))  # weights are pre-dropout probs
    torch.manual_seed(2)
    assert _err(mha(x), a) > 1e-3
    # With the weights too, dropout still acts on the output, and the weights are the eval
    # mode's (before dropout; torch.nn.MultiheadAttention would return them after dropout).
    assert _err(a_w, ref(x)) > 1e-3
    _, w_eval = ref(x, need_weights=True)
    assert _err(w, w_eval) < 1e-7


def test_state_dict_round_trip():
    torch.manual_seed(0)
    cfg = dict(n_kv_heads=2, bias=True, qk_norm=True, rope=True)
    a = qkv.MultiHeadAttention(32, 4, **cfg)
    keys = set(a.state_dict())
    assert keys == {
        f"{m}.{p}" for m in ("q_proj", "k_proj", "v_proj", "out_proj") for p in ("weight", "bias")
    } | {"q_norm.weight", "k_norm.weight"}
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = qkv.MultiHeadAttention(32, 4, **cfg)
    b.load_state_dict(torch.load(buf))
    x = torch.randn(2, 5, 32)
    assert torch.equal(a(x, mask=qkv.causal), b(x, mask=qkv.causal))


def test_gradients_reach_inputs_and_context():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, n_kv_heads=2, kdim=24, vdim=16)
    x = torch.randn(2, 5, 32, requires_grad=True)
    xk = torch.randn(2, 7, 24, requires_grad=True)
    xv = torch.randn(2, 7, 16, requires_grad=True)
    mha(x, (xk, xv)).pow(2).sum().backward()
    for t in (x, xk, xv):
        assert t.grad is not None and float(t.grad.abs().max()) > 0


@pytest.mark.parametrize(
    "compiler",
    # inductor's C++ code generation takes ~25 s here; make test keeps inductor for the
    # window's forward and backward (tests/test_compile.py) and traces the module with
    # aot_eager (the graph inductor would compile); make test-all runs inductor here too
    ["aot_eager", pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.extended])],
)
def test_torch_compile_cpu(compiler: str):
    """The module traces into one graph (fullgraph=True: no graph breaks) and the compiled
    forward equals eager; the backward is checked through aot_eager."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, n_kv_heads=2, rope=True, bias=True)
    x = torch.randn(2, 9, 32)
    want = mha(x, mask=qkv.causal)
    with torch.no_grad():
        got = torch.compile(mha, fullgraph=True, backend=compiler)(x, mask=qkv.causal)
    assert _err(got, want) < 1e-6
    do = torch.randn_like(want)
    grads = torch.autograd.grad((want * do).sum(), list(mha.parameters()))
    out = torch.compile(mha, backend="aot_eager", fullgraph=True)(x, mask=qkv.causal)
    got_grads = torch.autograd.grad((out * do).sum(), list(mha.parameters()))
    assert all(_err(a, b) < 1e-6 for a, b in zip(got_grads, grads, strict=True))


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "kw", "exc", "words"),
    [
        ((30, 4), {}, ValueError, ["d_model=30", "n_heads=4", "[1, 2, 3, 5, 6, 10, 15, 30]"]),
        ((32, 8), {"n_kv_heads": 3}, ValueError, ["n_heads=8", "n_kv_heads=3", "[1, 2, 4, 8]"]),
        ((30, 2), {"rope": True}, ValueError, ["head_dim", "15", "odd"]),
        ((32, 4), {"rope": qkv.RotaryEmbedding(16)}, ValueError, ["16", "head_dim", "8"]),
        ((32, 4), {"dropout": 1.0}, ValueError, ["dropout", "1.0"]),
        ((32, 0), {}, ValueError, ["n_heads", "0"]),
        ((32, 4), {"kdim": -3}, ValueError, ["kdim", "-3"]),
        ((32, 4), {"rope": "yes"}, TypeError, ["rope", "str"]),
        ((32, 4), {"bias": 1}, TypeError, ["bias"]),
    ],
)
def test_bad_config_fails_in_init(args, kw, exc, words):
    with pytest.raises(exc) as e:
        qkv.MultiHeadAttention(*args, **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_wrong_widths_fail_in_forward():
    mha = qkv.MultiHeadAttention(32, 4, kdim=16, vdim=16)
    with pytest.raises(ValueError, match=r"width 31.*d_model=32"):
        mha(torch.randn(2, 5, 31), torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"width 32.*kdim=16"):
        mha(torch.randn(2, 5, 32), torch.randn(2, 5, 32))
    with pytest.raises(ValueError, match="kdim=16"):
        mha(torch.randn(2, 5, 32))  # self-attention needs kdim == d_model
    with pytest.raises(ValueError, match="batch size 2 but x_kv has 3"):
        mha(torch.randn(2, 5, 32), torch.randn(3, 5, 16))
    with pytest.raises(ValueError, match="both batched"):
        mha(torch.randn(2, 5, 32), torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"\[B, L, d_model=32\]"):
        mha(torch.randn(1, 2, 5, 32), torch.randn(5, 16))
    with pytest.raises(TypeError, match="float64"):
        mha(torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 5, 16))
    kv = qkv.MultiHeadAttention(32, 4, kdim=16, vdim=8)
    with pytest.raises(ValueError, match=r"x_kv=\(x_k, x_v\)"):
        kv(torch.randn(2, 5, 32), torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="vdim=8"):
        kv(torch.randn(2, 5, 32), (torch.randn(2, 5, 16), torch.randn(2, 5, 16)))

"""The decoder's one-token step (``models/_llama_step.py``): the same logits and caches as
the decoder's forward, bit for bit, on GGUF blocks (exact and int8 activations, stacked and
unstacked projections) and on float32 weights; taken by the decoding loop only where it
stands in exactly."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from torch import nn

from qkv.models import LlamaConfig, LlamaDecoder, quantized
from qkv.models._generate import Sampling, decode_tokens
from qkv.models._llama_step import Stepper, can_step, step

gguf = pytest.importorskip("gguf")

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None, reason="no C++ compiler to build qkv's CPU kernel"
)


def _decoder(*, blocks: bool, mixed: bool = False, seed: int = 0) -> LlamaDecoder:
    """A 2-layer Llama (3 query heads over 1 key/value head of 32, d_ff 160, 100 tokens,
    tied head) with random weights; with ``blocks``, every linear weight quantised to Q4_1
    blocks (the head's to Q8_0) and multiplied by the kernel. ``mixed`` stores layer 1's
    ``v_proj`` and ``up`` in Q8_0: those layers' products cannot be stacked."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(100, 96, 2, 3, 1, 160, 64, 10000.0, 1e-5, True, "tiny")
    dec = LlamaDecoder(cfg).eval()
    for p in dec.parameters():
        nn.init.normal_(p, std=0.2)
    if not blocks:
        return dec
    raw: dict[str, tuple[str, torch.Tensor]] = {}
    for name, p in dec.named_parameters():
        if p.ndim != 2:
            continue
        fmt = "Q8_0" if name == "embed.weight" else "Q4_1"
        if mixed and name in ("layers.1.attention.v_proj.weight", "layers.1.up.weight"):
            fmt = "Q8_0"
        q = gguf.quants.quantize(p.detach().numpy(), gguf.GGMLQuantizationType[fmt])
        w = gguf.quants.dequantize(q, gguf.GGMLQuantizationType[fmt]).reshape(p.shape)
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))
        raw[name] = (fmt, torch.from_numpy(q))
    path = quantized.use_blocks(dec, raw)
    assert path.kernel is not None, quantized.LIBRARY.disabled()
    return dec


def _int8(dec: LlamaDecoder, on: bool) -> None:
    for m in dec.modules():
        if isinstance(m, quantized.QuantizedLinear):
            m.int8_activations = on


def _assert_same_steps(dec: LlamaDecoder, rows: int, *, exact: bool = True) -> None:
    """Prefill two sets of caches alike, then feed both the same tokens: one set through the
    forward, the other through the step; logits and cached keys/values compared."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 100, (rows, 5), generator=g)
    with torch.inference_mode():
        ref, fast = dec.new_caches(11), dec.new_caches(11)
        dec(ids, caches=ref, last_only=True)
        dec(ids, caches=fast, last_only=True)
        tok = torch.randint(0, 100, (rows, 1), generator=g)
        for _ in range(6):
            assert can_step(dec, fast)
            want = dec(tok, caches=ref, last_only=True).logits
            got = step(dec, tok, fast)
            assert got.shape == want.shape == (rows, 1, 100)
            if exact:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            tok = want[:, -1].argmax(-1)[:, None]
        assert [c.length for c in fast] == [c.length for c in ref] == [11, 11]
        for a, b in zip(ref, fast, strict=True):
            assert a._k is not None and b._k is not None and a._v is not None and b._v is not None
            if exact:
                assert torch.equal(a._k[:, :, :11], b._k[:, :, :11])
                assert torch.equal(a._v[:, :, :11], b._v[:, :, :11])
            else:
                torch.testing.assert_close(a._k[:, :, :11], b._k[:, :, :11])
        assert not can_step(dec, fast)  # full: the forward raises the overflow error


@needs_compiler
@pytest.mark.parametrize("mixed", [False, True], ids=["stacked", "mixed formats"])
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_step_equals_the_forward_on_blocks(mixed: bool, int8: bool, rows: int) -> None:
    dec = _decoder(blocks=True, mixed=mixed)
    _int8(dec, int8)
    _assert_same_steps(dec, rows)
    # the stacked parts hold row views of one buffer; a module called alone gives what it gave
    a = dec.layers[0].attention
    q_blocks, k_blocks = a.q_proj.blocks, a.k_proj.blocks
    assert k_blocks.data_ptr() == q_blocks.data_ptr() + q_blocks.nbytes
    _assert_same_steps(dec, rows)  # again, on the stack made by the first run
    _int8(dec, not int8)  # the arithmetic changed: the stack is made again
    _assert_same_steps(dec, rows)


def test_step_equals_the_forward_on_float32_weights() -> None:
    _assert_same_steps(_decoder(blocks=False), 2, exact=False)


@needs_compiler
def test_the_decoding_loop_takes_the_step_only_where_it_stands_in(monkeypatch) -> None:
    dec = _decoder(blocks=True, seed=1)
    calls: list[int] = []
    real = Stepper.__call__

    def spy(self, ids, caches):
        calls.append(ids.shape[0])
        return real(self, ids, caches)

    monkeypatch.setattr(Stepper, "__call__", spy)
    s = Sampling(8, 0.0, 1.0, None)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    fast = [t.tolist() for t in decode_tokens(dec, prompts, s, pad_id=0)]
    assert calls == [2] * 7  # every token after the first
    monkeypatch.setattr(Stepper, "can_step", lambda *a: False)
    assert [t.tolist() for t in decode_tokens(dec, prompts, s, pad_id=0)] == fast
    monkeypatch.undo()
    monkeypatch.setattr(Stepper, "__call__", spy)
    calls.clear()
    list(decode_tokens(dec, [[5, 6, 7], [9, 10, 11, 12]], s, pad_id=0))  # left-padded
    handle = dec.layers[1].attention.register_forward_hook(lambda *a: None)
    try:
        list(decode_tokens(dec, prompts, s, pad_id=0))  # a hook sees every module call
    finally:
        handle.remove()
    assert calls == []
    with torch.inference_mode():
        caches = dec.new_caches(8)
        assert not can_step(dec, caches)  # nothing prefilled yet
        dec(torch.tensor([[1, 2]]), caches=caches)
        assert can_step(dec, caches)
        dec.train()
        assert not can_step(dec, caches)
        dec.eval()
    assert not can_step(dec, caches)  # autograd on


@needs_compiler
@pytest.mark.parametrize("d", [1, 7, 59, 96, 576])
def test_the_compiled_rms_norm_is_torchs_to_float32_rounding(d: int) -> None:
    """The decoder's norms (``llama.RMSNorm``) run one compiled call on float32 CPU rows once
    the GGUF library is built: equal to ``F.rms_norm`` within float32 rounding of the float64
    formula, for widths no vector divides, several rows, a strided input and a NaN row (NaN,
    as the formula); with gradients (or without the library) it is ``F.rms_norm`` itself."""
    from qkv.models.llama import RMSNorm

    assert quantized.kernel() is not None, quantized.LIBRARY.disabled()
    norm = RMSNorm(d, eps=1e-5)
    g = torch.Generator().manual_seed(d)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g))
    x = (torch.randn(5, 2 * d, generator=g) * 3)[:, ::2]  # [5, d], stride 2 along d
    x[3] = float("nan")
    with torch.inference_mode():
        got = norm(x)
        plain = torch.nn.functional.rms_norm(x, [d], norm.weight, 1e-5)
        x64, w64 = x.double(), norm.weight.double()
        exact = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * w64
    assert got.isnan()[3].all() and not got[[0, 1, 2, 4]].isnan().any()
    keep = [0, 1, 2, 4]
    err = (got[keep].double() - exact[keep]).abs().max().item()
    plain_err = (plain[keep].double() - exact[keep]).abs().max().item()
    scale = exact[keep].abs().max().item()
    assert err <= 2 * plain_err + 4e-7 * scale, (err, plain_err, scale)
    ops = quantized.LIBRARY.ops_if_built()
    assert ops is not None
    assert torch.equal(got[keep], ops.rms_norm(x, norm.weight, 1e-5)[keep])  # the compiled call ran
    xg = x[keep].clone().requires_grad_()
    with torch.enable_grad():
        y = norm(xg)  # gradients: torch's own, bit for bit
    assert torch.equal(y, torch.nn.functional.rms_norm(xg, [d], norm.weight, 1e-5))
    y.sum().backward()
    assert xg.grad is not None and xg.grad.isfinite().all()

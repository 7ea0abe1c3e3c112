"""qkv's compiled kernel for GGUF blocks (``src/qkv/models/kernels/quant.cpp``)
against the oracle: float32 ``F.linear`` on the weights ``gguf.quants.dequantize`` makes, both
measured against the same product in float64; the blocks' dequantisation bit for bit; the
module's choice of path; and the decoder's fallback when the kernel cannot be built.

The kernel is built on first use (~15 s once per CPU capability, cached). Where a C++ compiler
exists these tests require it to build; without one the kernel tests skip and the fallback
test still runs. ``make test`` reruns this file with ``ATEN_CPU_CAPABILITY=avx2`` and
``=default`` (the kernel's AVX2 and portable variants).
"""

from __future__ import annotations

import logging
import shutil
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.models import quantized

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None, reason="no C++ compiler to build qkv's CPU kernel"
)
FORMATS = tuple(quantized.FORMATS)  # Q4_0, Q4_1, Q8_0


def _blocks(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks uint8 [n, k / 32 * bytes], weights float32 [n, k])``: random bytes for the
    4- and 8-bit values (every nibble and int8, both signs), with scales and minimums of
    either sign spread over fp16's range (subnormals included); ``weights`` is what
    ``gguf.quants.dequantize`` makes of the blocks."""
    size = quantized.FORMATS[fmt][1]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    n_scales = 2 if fmt == "Q4_1" else 1  # d (and Q4_1's m) lead each block as fp16
    shape = (n, k // 32, n_scales)
    scales = rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 2, shape)
    raw[..., : 2 * n_scales] = scales.astype(np.float16).view(np.uint8).reshape(n, k // 32, -1)
    raw = raw.reshape(n, -1)
    w = gguf.quants.dequantize(raw, T[fmt]).reshape(n, k)
    return torch.from_numpy(raw), torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


# (out_features, in_features): a single block, out_features that no SIMD width divides, the
# model's shapes (576 and 1536 inputs), in_features of an odd number of blocks
SHAPES = [(1, 32), (7, 96), (33, 544), (100, 576), (61, 1536), (5, 32 * 37)]
ROWS = [1, 2, 3, 5, 8, quantized.MAX_ROWS]  # the kernel takes rows four at a time


@needs_compiler
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=str)
def test_kernel_matches_the_oracle(fmt: str, n: int, k: int) -> None:
    """x @ W.T from the blocks is float32 F.linear on the dequantised W to float32 rounding:
    its error against the float64 product is within 2x of F.linear's own (plus a hair for the
    cases where F.linear's is zero), for 1 to MAX_ROWS rows."""
    assert quantized.kernel() is not None, quantized.LIBRARY.disabled()
    seed = zlib.crc32(repr((fmt, n, k)).encode())
    blocks, w = _blocks(fmt, n, k, seed)
    assert torch.equal(quantized.dequantize(blocks, fmt, k), w)  # bit for bit as gguf's
    layer = quantized.QuantizedLinear(nn.Parameter(w, requires_grad=False), blocks, fmt)
    g = torch.Generator().manual_seed(seed)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g) * 3
        with torch.inference_mode():
            got = layer(x)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        _assert_float32_linear(got, x, w)


def _assert_float32_linear(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` is ``F.linear(x, w)`` to float32 rounding: its error against the float64
    product within 2x of F.linear's own, plus a hair (1e-7 of the largest sum of |products|)
    where F.linear's is zero."""
    exact = x.double() @ w.double().T  # [rows, n]
    plain = (F.linear(x, w).double() - exact).abs().max().item()
    err = (got.double() - exact).abs().max().item()
    size = (x.double().abs() @ w.double().abs().T).max().item()
    assert err <= 2 * plain + 1e-7 * size, (x.shape[0], err, plain, size)


@needs_compiler
def test_the_file_quantiser_round_trip() -> None:
    """Blocks as gguf's quantiser writes them (what a GGUF file holds), each format."""
    x = np.random.default_rng(1).standard_normal((40, 576)).astype(np.float32)
    for fmt in FORMATS:
        raw = torch.from_numpy(gguf.quants.quantize(x, T[fmt]))
        w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), T[fmt]).reshape(40, 576))
        assert torch.equal(quantized.dequantize(raw, fmt, 576), w)
        v = torch.randn(1, 576)
        got = quantized.kernel().linear(v, raw, quantized.FORMATS[fmt][0], 576)
        _assert_float32_linear(got, v, w)


@needs_compiler
def test_which_inputs_take_the_kernel(monkeypatch) -> None:
    """Up to MAX_ROWS rows of float32 without gradients: the kernel (any leading shape);
    more rows, another dtype, or a gradient to compute: F.linear on the float32 weight."""
    blocks, w = _blocks("Q4_1", 24, 64, 7)
    layer = quantized.QuantizedLinear(nn.Parameter(w), blocks, "Q4_1")
    ops = quantized.kernel()
    calls: list[int] = []

    class Spy:
        def linear(self, x, *args):
            calls.append(x.shape[0])
            return ops.linear(x, *args)

    monkeypatch.setattr(quantized, "kernel", lambda: Spy())
    most = quantized.MAX_ROWS
    x = torch.randn(2, most // 2, 64)  # [2, L, in]: MAX_ROWS rows
    with torch.no_grad():
        out = layer(x)
        assert calls == [most] and out.shape == (2, most // 2, 24)
        _assert_float32_linear(out.view(most, 24), x.view(most, 64), w)
        layer(torch.randn(1, most + 1, 64))
        layer(torch.randn(1, 64))  # one row: the kernel
    assert calls == [most, 1]  # MAX_ROWS + 1 rows went to F.linear
    y = layer(torch.randn(1, 64))  # grad mode and a weight that wants a gradient
    assert calls == [most, 1] and y.requires_grad
    with torch.no_grad(), pytest.raises(RuntimeError):
        layer(torch.randn(1, 64).double())  # not float32: F.linear, which refuses the mix
    with pytest.raises(ValueError, match="do not hold"):
        quantized.QuantizedLinear(nn.Parameter(w), blocks[:, :-1], "Q4_1")


def test_the_decoder_falls_back_to_float32_weights(monkeypatch, caplog) -> None:
    """A build that fails (or QKV_NATIVE=0): the decoder keeps nn.Linear on the float32
    weights (today's path), logs one line, and says why in linear_path and its repr."""
    import qkv.models

    monkeypatch.setattr(quantized.LIBRARY, "_state", {})

    def broken():
        raise RuntimeError("c++: command not found\nmore detail")

    monkeypatch.setattr(quantized.LIBRARY, "_build", broken)
    with caplog.at_level(logging.WARNING, logger="qkv"):
        model = qkv.models.load("smollm2")
    assert model.linear_path.kernel is None
    assert "c++: command not found" in str(model.linear_path) and "float32" in repr(model)
    assert not any(isinstance(m, quantized.QuantizedLinear) for m in model.modules())
    assert sum("compiled kernel failed" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setenv("QKV_NATIVE", "0")
    off = qkv.models.load("smollm2")
    assert "QKV_NATIVE=0" in str(off.linear_path)
    with pytest.raises(RuntimeError, match="compiled kernel"):
        off.quantize_activations()
    assert isinstance(off.decoder.layers[0].gate, nn.Linear)
    # the same tokens as the kernel's decoding (where there is one); the patches undone
    # first, or the shared model of decoder_testing would be cached without the kernel
    from decoder_testing import smollm2

    monkeypatch.undo()
    fast = smollm2()
    if fast.linear_path.kernel is not None:
        prompt = "The capital of France is"
        assert off.generate(prompt, max_new_tokens=8) == fast.generate(prompt, max_new_tokens=8)


# ------------------------------------------------- int8 activations (kernels/quant_int.cpp)


def _q8(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` as the int8 path sees it, in torch: blocks of 32 quantised to a scale
    ``d = max|x| / 127`` and ``round_half_even(x / d)`` clamped to +-127, dequantised."""
    xb = x.reshape(x.shape[0], -1, 32)  # [M, K / 32, 32]
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xb / d), 0.0).clamp(-127, 127)
    return (q * d).reshape(x.shape)


def _term_sizes(fmt: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``[n, k]`` bounds on the size of the terms the kernel sums for each weight: Q4_1's
    weight is ``d q + m`` and Q4_0's ``d q - 8 d``, summed as two products that may cancel."""
    size = quantized.FORMATS[fmt][1]
    head = blocks.view(n, k // 32, size)[..., :4].contiguous()
    d = head[..., :2].contiguous().view(torch.float16).float().abs()  # [n, k / 32, 1]
    if fmt == "Q8_0":
        return (d * 128).repeat_interleave(32, 1).reshape(n, k)
    extra = (
        head[..., 2:4].contiguous().view(torch.float16).float().abs() if fmt == "Q4_1" else 8 * d
    )
    return (d * 15 + extra).repeat_interleave(32, 1).reshape(n, k)


def _assert_q8_linear(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> None:
    """``got`` is the float64 product of the quantised ``x`` and ``w`` to float32 rounding:
    within 2e-6 of the sum of the term sizes (one step of an input's quantisation is ~1e-4 of
    it at these lengths, so a value quantised otherwise fails)."""
    xq = _q8(x).double()
    exact = xq @ w.double().T  # [rows, n]
    bound = 2e-6 * (xq.abs() @ t.double().T) + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), (x.shape, (err / bound).max().item())


# out_features odd, in_features of 1, 3, 18, 37 and 48 blocks (the model's 576 and 1536)
INT_SHAPES = [(1, 32), (7, 96), (33, 576), (61, 1536), (5, 32 * 37)]


@needs_compiler
@pytest.mark.parametrize("vnni", ["1", "0"], ids=["vnni where present", "QKV_QUANT_VNNI=0"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), INT_SHAPES, ids=str)
def test_int8_kernel_matches_the_quantised_formula(
    fmt: str, n: int, k: int, vnni: str, monkeypatch
) -> None:
    """linear_q8 is the float64 product of the torch-quantised activations and the weights to
    float32 rounding, for 1, 3, 7 and MAX_ROWS rows, a strided input, a block of zeros (scale
    0) and one of tiny values (a subnormal scale). Under AVX-512 the kernel multiplies bytes
    with VNNI where the CPU has it, else (and with QKV_QUANT_VNNI=0) with AVX512BW."""
    monkeypatch.setenv("QKV_QUANT_VNNI", vnni)
    assert quantized.kernel() is not None, quantized.LIBRARY.disabled()
    seed = zlib.crc32(repr(("q8", fmt, n, k)).encode())
    blocks, w = _blocks(fmt, n, k, seed)
    t = _term_sizes(fmt, blocks, n, k)
    g = torch.Generator().manual_seed(seed)
    for rows in (1, 3, 7, quantized.MAX_ROWS):
        x = torch.randn(rows, k, generator=g) * 3
        x[0, :32] = 0.0
        x[-1, -32:] *= 1e-39
        got = quantized.linear_q8(x, blocks, fmt, k)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        _assert_q8_linear(got, x, w, t)
    wide = torch.randn(k, 3, generator=g).T  # [3, k], column-major: not contiguous
    _assert_q8_linear(quantized.linear_q8(wide, blocks, fmt, k), wide, w, t)


@needs_compiler
@pytest.mark.parametrize("vnni", ["1", "0"], ids=["vnni where present", "QKV_QUANT_VNNI=0"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_kernel_keeps_nan_and_inf(fmt: str, vnni: str, monkeypatch) -> None:
    """A row holding a NaN or an infinity is multiplied in float32: NaN and inf come out where
    F.linear puts them; the finite rows beside it are the quantised product."""
    monkeypatch.setenv("QKV_QUANT_VNNI", vnni)
    blocks, w = _blocks(fmt, 9, 96, 3)
    x = torch.randn(4, 96)
    x[1, 40] = float("nan")
    x[2, 5] = float("inf")
    x[3, 70] = -float("inf")
    got = quantized.linear_q8(x, blocks, fmt, 96)
    ref = F.linear(x, w)
    assert torch.equal(got.isnan(), ref.isnan()) and bool(got[1].isnan().all())
    assert torch.equal(got.isinf(), ref.isinf()) and torch.equal(
        got.isinf() & (got > 0), ref.isinf() & (ref > 0)
    )
    _assert_q8_linear(got[:1], x[:1], w, _term_sizes(fmt, blocks, 9, 96))


@needs_compiler
def test_int8_activations_switch(monkeypatch) -> None:
    """QuantizedLinear.int8_activations sends the kernel's inputs to linear_q8; many-row
    inputs stay F.linear; a bad switch value is refused."""
    blocks, w = _blocks("Q4_1", 24, 64, 9)
    layer = quantized.QuantizedLinear(nn.Parameter(w), blocks, "Q4_1")
    ops = quantized.kernel()
    calls: list[str] = []

    class Spy:
        def linear(self, x, *args):
            calls.append("linear")
            return ops.linear(x, *args)

        def linear_q8(self, x, *args):
            calls.append("linear_q8")
            return ops.linear_q8(x, *args)

    monkeypatch.setattr(quantized, "kernel", lambda: Spy())
    x = torch.randn(1, 2, 64)
    with torch.no_grad():
        layer(x)
        layer.int8_activations = True
        out = layer(x)
        layer(torch.randn(quantized.MAX_ROWS + 1, 64))
    assert calls == ["linear", "linear_q8"]
    _assert_q8_linear(out.view(2, 24), x.view(2, 64), w, _term_sizes("Q4_1", blocks, 24, 64))
    assert "int8 activations" in repr(layer)


@needs_compiler
def test_int8_activations_decode_near_the_exact_argmax() -> None:
    """SmolLM2 with int8 activations: its logits move (the path runs) about as far from the
    exact ones as llama.cpp's do (measured on this prompt, at the last position: llama.cpp
    max 0.62, mean 0.11; int8 max 1.01, mean 0.25; the argmax the same), and every token it
    picks greedily is within 0.5 of the exact model's best logit on the same prefix:
    quantised activations move logits by tenths, so near-ties may flip (after "The capital
    of France is" the two paths agree on " Paris.\n\nThe", then take near-tied ways)."""
    from decoder_testing import smollm2

    model = smollm2()
    prompt = "The capital of France is"
    ids = model._ids(prompt)
    x = torch.tensor([ids])  # [1, L]
    with torch.inference_mode():
        exact = model(x).logits[0, -1]
        model.quantize_activations()
        try:
            assert "int8 activations" in str(model.linear_path)
            fast = model(x).logits[0, -1]
            model.generate(prompt, max_new_tokens=16)
            new = model.last_tokens[0]
        finally:
            model.quantize_activations(False)
        assert "int8" not in str(model.linear_path)
        moved = (fast - exact).abs()
        assert 1e-4 < moved.mean().item() < 0.5 and moved.max().item() < 2.0, moved.max()
        assert fast.argmax() == exact.argmax()
        logits = model(torch.tensor([ids + new])).logits[0, len(ids) - 1 : -1]  # [16, vocab]
    picked = logits.gather(1, torch.tensor(new)[:, None])[:, 0]
    gaps = logits.max(1).values - picked
    assert float(gaps.max()) < 0.5, gaps.tolist()
    with pytest.raises(TypeError, match="bool"):
        model.quantize_activations(1)  # type: ignore[arg-type]

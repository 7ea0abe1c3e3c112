"""Linear layers on GGUF's quantised blocks: ``x @ W.T`` computed from the file's Q4_0, Q4_1
or Q8_0 blocks by qkv's compiled kernel (``kernels/quant.cpp``) for inputs of a few rows.

Why (benchmarks/RESULTS.md): a decode step is one matrix-vector product per weight
matrix, bound by reading the weights: SmolLM2-135M's are 538 MB a token as float32 and 96 MB
as the file's blocks. The kernel decodes each block of 32 weights exactly as
``gguf.quants.dequantize`` does and multiplies it into float32 accumulators, so its result is
float32 ``F.linear`` on the dequantised weights up to the order of the float32 sums
(``tests/test_quantized.py``).

Two arithmetics for those few-row products (``QuantizedLinear.int8_activations``):

- exact (the default): the float32 product above. A model's logits then match other float32
  implementations of the same weights (transformers reading the GGUF file) to float32
  rounding, and greedy decoding gives their tokens.
- int8 activations (``kernels/quant_int.cpp``, opt-in with
  :meth:`TextDecoder.quantize_activations`): each input row is quantised to 8-bit blocks of
  32 (a scale ``max|x| / 127`` and 32 int8, as llama.cpp's Q8 formats), and each weight block
  times an input block is an integer dot product of 32 small integers (under AVX-512,
  ``kernels/quant_pairs.cpp``: two blocks per vector, with VNNI where the CPU has it). It is
  llama.cpp's arithmetic and faster (benchmarks/RESULTS.md: decoding SmolLM2 at one thread),
  but it changes the result by up to half a quantisation step of each input value, so logits
  move by ~0.1 and near-tied tokens can swap; it is not the default for that reason.

When the kernel cannot be built (no C++ compiler, ``QKV_NATIVE=0``, a failed build) the
loader keeps plain ``nn.Linear`` layers on the dequantised float32 weights, as before; the
decoder's ``linear_path`` says which path runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..native import NativeLibrary, capability

Tensor = torch.Tensor

__all__ = [
    "FORMATS",
    "MAX_ROWS",
    "LinearPath",
    "QuantizedLinear",
    "dequantize",
    "kernel",
    "linear_q8",
]

# GGUF block formats the kernel reads: name -> (GGML type code, bytes per block of 32).
FORMATS = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
BLOCK = 32  # weights per block (the format's)

# Inputs of up to this many rows take the kernel; more rows take F.linear on the float32
# weights (a GEMM reuses each weight for every row, where the kernel reads the blocks once
# per 4 rows). SmolLM2's forward over the KV cache on a 2-core AVX-512 VM, kernel vs float32:
# 1 row 16 vs 52 ms, 8 rows 34 vs 71, 16 rows 56 vs 84, 32 rows 98-100 vs 115;
# the float32 GEMM wins beyond ~40 rows, and a 1024-token prefill is at parity with the peer
# only on float32 weights (dequantising the blocks on the fly: 1.76-1.82 s vs 1.71-1.72 s).
MAX_ROWS = 32


def _fake_linear(x: Tensor, blocks: Tensor, qtype: int, k: int) -> Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def _fake_dequantize(blocks: Tensor, qtype: int, k: int) -> Tensor:
    return blocks.new_empty(blocks.shape[0], k, dtype=torch.float32)


LIBRARY = NativeLibrary(
    "qkv_quant",
    [
        Path(__file__).parent / "kernels" / "quant.cpp",
        Path(__file__).parent / "kernels" / "quant_int.cpp",
        Path(__file__).parent / "kernels" / "quant_pairs.cpp",
    ],
    what="CPU kernel for GGUF blocks",
    # the weights must round as gguf's numpy does (a product, then a sum): no fused d*q + m
    extra_cflags=["-ffp-contract=off"],
    fakes={
        "linear": _fake_linear,
        "linear_q8": _fake_linear,
        "dequantize": _fake_dequantize,
        "rms_norm": lambda x, weight, eps: torch.empty_like(x),
    },
)


def kernel() -> Any | None:
    """The compiled operators (``linear``, ``linear_q8``, ``dequantize``), building them on
    first use; ``None`` when they cannot be had (the reason: ``LIBRARY.disabled()``)."""
    return LIBRARY.ops()


def _ops() -> Any:
    ops = kernel()
    if ops is None:
        why = LIBRARY.disabled()
        raise RuntimeError(f"qkv's compiled kernel for GGUF blocks is unavailable: {why}")
    return ops


def dequantize(blocks: Tensor, qtype: str, in_features: int) -> Tensor:
    """``blocks`` uint8 ``[N, in_features / 32 * bytes]`` of format ``qtype`` → float32
    ``[N, in_features]``, equal to ``gguf.quants.dequantize`` bit for bit."""
    return _ops().dequantize(blocks, FORMATS[qtype][0], in_features)


def linear_q8(x: Tensor, blocks: Tensor, qtype: str, in_features: int) -> Tensor:
    """``x`` float32 ``[M, in_features]`` times the weights of ``blocks`` (uint8 ``[N,
    in_features / 32 * bytes]``, format ``qtype``) transposed, with ``x`` quantised to 8-bit
    blocks of 32 (``kernels/quant_int.cpp``): ``[M, N]``. Rows holding a NaN or an infinity
    are multiplied in float32."""
    return _ops().linear_q8(x, blocks, FORMATS[qtype][0], in_features)


@dataclass(frozen=True)
class LinearPath:
    """Which linear path a decoder's weight matrices run, decided once by the loader."""

    kernel: str | None  # e.g. "AVX512": the compiled kernel runs inputs of <= MAX_ROWS rows
    formats: tuple[tuple[str, int], ...]  # (format, how many matrices) on the kernel
    reason: str  # why: what the kernel covers, or why it does not run
    int8_activations: bool = False  # the kernel quantises its inputs to 8 bits (not exact)

    def __str__(self) -> str:
        if self.kernel is None:
            return f"float32 F.linear ({self.reason})"
        counts = ", ".join(f"{n} {f}" for f, n in self.formats)
        how = "int8 activations" if self.int8_activations else "float32"
        return (
            f"GGUF blocks ({counts}): qkv's {self.kernel} kernel ({how}) <= {MAX_ROWS} rows, "
            f"else float32"
        )


class QuantizedLinear(nn.Module):
    """``nn.Linear`` without bias whose small inputs are multiplied from GGUF blocks.

    Holds ``weight`` (the float32 dequantised matrix ``[out_features, in_features]``, as the
    ``nn.Linear`` it replaces: many-row inputs, gradients and every reader of ``.weight`` use
    it) and ``blocks`` (uint8 ``[out_features, in_features / 32 * bytes]``, the file's blocks;
    a buffer outside the state dict). ``forward(x [..., in_features]) -> [..., out_features]``
    equals ``F.linear(x, weight)`` to float32 rounding; with ``int8_activations`` set, inputs
    the kernel takes are first quantised to 8-bit blocks (see the module docstring).
    """

    def __init__(self, weight: nn.Parameter, blocks: Tensor, qtype: str) -> None:
        super().__init__()
        n, k = weight.shape
        code, size = FORMATS[qtype]
        if k % BLOCK or tuple(blocks.shape) != (n, k // BLOCK * size):
            raise ValueError(
                f"{qtype} blocks of shape {list(blocks.shape)} do not hold a [{n}, {k}] weight; "
                f"expected [{n}, {k // BLOCK * size}] (in_features a multiple of {BLOCK})"
            )
        self.in_features, self.out_features, self.qtype = k, n, qtype
        self._code = code
        self._most = MAX_ROWS * k  # the most input values the kernel takes
        self.int8_activations = False
        self.weight = weight
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)

    def _takes_kernel(self, x: Tensor) -> bool:
        # Written for speed: a SmolLM2 decode step makes 211 of these calls, and this module's
        # Python around the kernel cost ~7 us a call (1.5 ms of an 18 ms token) with the
        # buffer and device objects looked up through nn.Module's __getattr__.
        if x.dtype is not torch.float32 or x.device.type != "cpu":
            return False
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return False  # the kernel has no backward (inference mode skips this lookup)
        blocks = self._buffers["blocks"]
        return blocks is not None and not blocks.is_cuda and x.numel() <= self._most

    def forward(self, x: Tensor) -> Tensor:
        if self._takes_kernel(x):
            ops = kernel()
            if ops is not None:
                flat = x.reshape(-1, self.in_features)  # [rows, in]
                op = ops.linear_q8 if self.int8_activations else ops.linear
                out = op(flat, self._buffers["blocks"], self._code, self.in_features)  # [rows, out]
                return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"blocks={self.qtype}, kernel rows<={MAX_ROWS}"
            + (", int8 activations" if self.int8_activations else "")
        )


def use_blocks(decoder: nn.Module, blocks: dict[str, tuple[str, Tensor]]) -> LinearPath:
    """Replace the ``nn.Linear`` layers of ``decoder`` whose weights came from GGUF blocks
    (``blocks``: qkv parameter name → (format, uint8 blocks)) with :class:`QuantizedLinear`
    when the compiled kernel is available; returns the path that runs. A tied output head
    (its weight is the embedding's) takes the embedding's blocks."""
    formats = {name: fmt for name, (fmt, _) in blocks.items() if fmt in FORMATS}
    if not formats:
        return LinearPath(None, (), "no weight is stored in Q4_0, Q4_1 or Q8_0 blocks")
    if kernel() is None:
        return LinearPath(None, (), str(LIBRARY.disabled()))
    by_weight: dict[int, str] = {}  # a parameter's first name: a tied head's is embed.weight
    for n, p in decoder.named_parameters(remove_duplicate=False):
        by_weight.setdefault(id(p), n)
    swapped: dict[str, int] = {}
    for path, module in list(decoder.named_modules()):
        if not isinstance(module, nn.Linear) or module.bias is not None:
            continue
        name = by_weight.get(id(module.weight), f"{path}.weight")
        if name not in formats or module.weight.dtype != torch.float32:
            continue
        parent, _, attr = path.rpartition(".")
        owner = decoder.get_submodule(parent) if parent else decoder
        fmt, raw = blocks[name]
        setattr(owner, attr, QuantizedLinear(module.weight, raw, fmt))
        swapped[fmt] = swapped.get(fmt, 0) + 1
    return LinearPath(
        capability(),
        tuple(sorted(swapped.items())),
        "the many-row product of a prefill is a GEMM, faster on float32 weights",
    )

"""Linear layers with int8 weights, one scale per output channel, and an int8 matmul.

``Int8Linear`` holds ``qweight`` int8 ``[N, K]`` and ``scale`` float32 ``[N]`` with
``weight ≈ scale[:, None] * qweight`` (symmetric: ``scale = max |row| / 127``), quantised
once from a float ``nn.Linear`` (:meth:`Int8Linear.from_float`). Its forward quantises the
input to uint8 per call (one scale and zero point per call, from the input's min and max) and
multiplies in integers through torch's x86 dynamic-quantized linear
(``torch.ops.quantized.linear_dynamic`` on FBGEMM's packed weights), then adds the float bias:
faster-whisper's ``compute_type="int8"`` on a CPU, in torch.

Why FBGEMM (benchmarks/RESULTS.md, one thread of an AMD EPYC with AVX-512 VNNI, medians): a
``[1500, 384] x [384, 1536]`` product (Whisper tiny's encoder MLP) takes 5.7 ms against 19.7 ms
in float32 (MKL), where ``torch._int_mm`` with per-row input scales took 9.4 ms (its separate
quantise and rescale passes over the activations cost more than the product saves) and
``aten::_weight_int8pack_mm`` (int8 weights, bfloat16 inputs) 26 ms; at one row (a decoding
step) 0.03-0.04 ms against 0.02-0.06 ms in float32, reading a quarter of the bytes.

Activations use all 8 bits, and only where the product is exact: without VNNI, FBGEMM (and
oneDNN behind ``torch._int_mm``) add pairs of uint8 x int8 products in int16, which saturates
(255 * 127 * 2 > 32767). Measured on the Whisper test clips with ``FBGEMM_ENABLE_INSTRUCTIONS=
AVX2``: 92% word error against float32 on one clip (0% with VNNI); the usual cure, 7-bit
activations (``reduce_range``, torch's ``quantize_dynamic`` default), cost 69% on the same
clip, and 7-bit weights 42%. So :func:`kernel` tries the product once on values that would
saturate: where it is exact (AVX-512 VNNI, AMX) the layer runs FBGEMM's int8 product; where it
is not, or where this torch has no FBGEMM, ``F.linear`` on the weights dequantised once at
construction (the same int8 weights, float32 activations: int8's rounding, not its speed).
``QKV_INT8_KERNEL=fbgemm`` or ``=dequantized`` overrides the choice; ``Int8Linear.kernel``
says which runs.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor

__all__ = [
    "Int8Linear",
    "fbgemm_exact",
    "kernel",
    "pack_int8",
    "quantize_linears",
    "quantize_rows",
]

KERNELS = ("fbgemm", "dequantized")


@functools.cache
def fbgemm_exact() -> bool:
    """Whether FBGEMM's dynamic int8 product is exact where int16 pair sums would saturate:
    an input quantised to 255 everywhere times weights of 127 (the exact answer 64 * 127)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    q = torch.full((4, 64), 127, dtype=torch.int8)
    packed = pack_int8(q, torch.ones(4), None)
    x = torch.ones(2, 64)
    x[1] = 0  # the input's range is [0, 1]: a scale of 1/255, so every 1 becomes 255
    try:
        y = torch.ops.quantized.linear_dynamic(x, packed, False)
    except (RuntimeError, NotImplementedError):
        return False
    return bool((y[0] - 64 * 127).abs().max() < 1e-2 * 64 * 127)


def kernel() -> str:
    """The int8 product :class:`Int8Linear` runs here: ``"fbgemm"`` (int8 x int8 in int32,
    exact) or ``"dequantized"`` (float32 on the dequantised weights); ``QKV_INT8_KERNEL``
    overrides the choice."""
    forced = os.environ.get("QKV_INT8_KERNEL", "")
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"QKV_INT8_KERNEL={forced!r}; give one of {', '.join(KERNELS)}")
        if forced == "fbgemm" and "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError("QKV_INT8_KERNEL=fbgemm but this torch has no FBGEMM engine")
        return forced
    return "fbgemm" if fbgemm_exact() else "dequantized"


def _pack(qweight: Tensor, scale: Tensor, bias: Tensor | None) -> Any:
    """FBGEMM's packed form of ``qweight`` (per-channel ``scale``, zero points 0) and ``bias``."""
    q = torch._make_per_channel_quantized_tensor(
        qweight, scale.double(), torch.zeros_like(scale, dtype=torch.int64), 0
    )
    return torch.ops.quantized.linear_prepack(q, bias)


def pack_int8(qweight: Tensor, scale: Tensor, bias: Tensor | None) -> Any:
    """FBGEMM's packed weights for ``torch.ops.quantized.linear_dynamic``: ``qweight`` int8
    ``[N, K]`` with per-row ``scale`` ``[N]`` (zero points 0) and float ``bias`` ``[N]``."""
    # torch 2.13 warns that quantized tensor creation is deprecated; the qint8 tensor is only
    # FBGEMM's packing input here, dropped once packed, and no user code sees it.
    engine = torch.backends.quantized.engine
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions.*")
        try:
            # packed for FBGEMM whatever the global engine (x86's own choice is per shape)
            torch.backends.quantized.engine = "fbgemm"
            return _pack(qweight, scale, bias)
        finally:
            torch.backends.quantized.engine = engine


class Int8Linear(nn.Module):
    """``y = x @ (scale[:, None] * qweight).T + bias`` with an int8 matmul.

    Args:
        qweight: int8 ``[N, K]`` (``out_features, in_features``), values in -127..127.
        scale: float ``[N]``, positive: the weight of row ``n`` is ``scale[n] * qweight[n]``.
        bias: float ``[N]`` or None.

    Input float32 ``[..., K]`` → output float32 ``[..., N]``; CPU, inference only (no
    gradients). ``weight`` is the dequantised float32 ``[N, K]`` weight, made at each access.
    With the ``"fbgemm"`` kernel the input is quantised per call to uint8 with one scale and
    zero point from its min and max (as CTranslate2's and torch's dynamic int8 do per call).
    """

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        if not isinstance(qweight, Tensor) or qweight.dtype != torch.int8 or qweight.ndim != 2:
            got = (
                f"{qweight.dtype} {list(qweight.shape)}"
                if isinstance(qweight, Tensor)
                else type(qweight).__name__
            )
            raise TypeError(f"qweight must be an int8 [N, K] tensor, got {got}")
        N, K = qweight.shape
        if not isinstance(scale, Tensor) or scale.shape != (N,) or not bool((scale > 0).all()):
            raise ValueError(
                f"scale must be {N} positive floats (one per row of qweight "
                f"{list(qweight.shape)}), got "
                f"{list(scale.shape) if isinstance(scale, Tensor) else type(scale).__name__}"
            )
        if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (N,)):
            what = list(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"bias must be None or a [{N}] tensor, got {what}")
        self.in_features, self.out_features = K, N
        self.qweight: Tensor
        self.scale: Tensor
        self.bias: Tensor | None
        self.register_buffer("qweight", qweight.detach().contiguous())
        self.register_buffer("scale", scale.detach().float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.kernel = kernel()
        self._key: tuple[Any, ...] | None = None
        self._packed: Any = None
        self._prepare()

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        """``linear``'s weight quantised per output row (symmetric, ``max |row| / 127``)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_float takes an nn.Linear, got {type(linear).__name__}")
        q, scale = quantize_rows(linear.weight.detach())
        b = None if linear.bias is None else linear.bias.detach().float()
        return cls(q, scale, b)

    @property
    def weight(self) -> Tensor:
        """The dequantised weight ``scale[:, None] * qweight``, float32 ``[N, K]``."""
        return self.qweight.float() * self.scale[:, None]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, kernel={self.kernel}"
        )

    def _state(self) -> tuple[object, ...]:
        # where each buffer lives, its dtype and how often it was written: a move, a
        # conversion or a load_state_dict changes one of them (a few us at every call)
        ts = (self.qweight, self.scale, self.bias)
        return tuple(f(t) for t in ts if t is not None for f in (Tensor.data_ptr, _version, _dtype))

    def _prepare(self) -> None:
        """FBGEMM's packed weights, or the dequantised float32 weight, from the buffers."""
        if self.qweight.device.type != "cpu":
            raise ValueError(
                f"Int8Linear runs on the CPU only, its weights are on {self.qweight.device}; "
                f"keep int8 models on the CPU (compute_type='float32' elsewhere)"
            )
        if self.qweight.dtype != torch.int8:
            raise TypeError(f"Int8Linear's qweight must stay int8, got {self.qweight.dtype}")
        if self.kernel == "fbgemm":
            self._packed = pack_int8(self.qweight, self.scale, self.bias)
        else:
            self._packed = self.weight  # [N, K] float32, dequantised once
        self._key = self._state()

    def forward(self, x: Tensor) -> Tensor:
        if (
            not isinstance(x, Tensor)
            or x.dtype != torch.float32
            or x.shape[-1] != self.in_features
            or (x.requires_grad and torch.is_grad_enabled())
        ):
            self._refuse(x)
        if self._key != self._state():  # the buffers were written (load_state_dict) or moved
            self._prepare()
        if self.kernel != "fbgemm":
            return F.linear(x, self._packed, self.bias)
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        y = torch.ops.quantized.linear_dynamic(x2.contiguous(), self._packed, False)  # [M, N]
        return y.view(*x.shape[:-1], self.out_features)  # [..., N]

    def _refuse(self, x: object) -> None:
        if not isinstance(x, Tensor) or x.dtype != torch.float32:
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"Int8Linear takes float32 input, got {got}; convert with x.float()")
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"input has width {x.shape[-1]} (shape {list(x.shape)}) but this layer takes "
                f"in_features={self.in_features}"
            )
        raise ValueError(
            "Int8Linear is for inference: its input requires grad; run it under "
            "torch.no_grad() or use the float32 model for training"
        )


def _dtype(t: Tensor) -> torch.dtype:
    return t.dtype


def _version(t: Tensor) -> int:
    """How often ``t`` was written (-1 for an inference tensor, which keeps no count)."""
    return -1 if t.is_inference() else t._version  # (inference tensors have no counter)


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w`` float ``[N, K]`` → ``(q int8 [N, K], scale float32 [N])`` with ``w ≈ scale q``:
    each row's ``max |w| / 127`` (rows of zeros get scale 1), ``q = round(w / scale)``."""
    w = w.detach().float()
    amax = w.abs().amax(1)  # [N]
    scale = torch.where(amax > 0, amax / 127, 1.0)  # [N]
    # |w / scale| <= 127 up to float32 rounding, which round() takes back to 127: no clamp
    q = torch.div(w, scale[:, None]).round_().to(torch.int8)  # [N, K]
    return q, scale


def quantize_linears(module: nn.Module, *, skip: tuple[str, ...] = ()) -> nn.Module:
    """Every ``nn.Linear`` inside ``module`` (in place) replaced by its :class:`Int8Linear`,
    except those whose qualified name starts with one of ``skip``; returns ``module``.

    The weights of equal width are quantised together, a few large ops instead of six small
    ones per layer (rows are independent): with two threads on a busy 2-core machine, where
    each small op waits for both threads, Whisper tiny's int8 load took 4.6 s layer by layer
    and 1.2 s grouped (its float32 load: 0.8 s)."""
    found: list[tuple[nn.Module, str, nn.Linear]] = []
    for name, child in module.named_modules():
        for attr, sub in child.named_children():
            full = f"{name}.{attr}" if name else attr
            if type(sub) is nn.Linear and not full.startswith(skip):
                found.append((child, attr, sub))
    for width in sorted({lin.in_features for _, _, lin in found}):
        group = [(parent, attr, lin) for parent, attr, lin in found if lin.in_features == width]
        q, scale = quantize_rows(torch.cat([lin.weight.detach() for _, _, lin in group]))
        rows = [lin.out_features for _, _, lin in group]
        for (parent, attr, lin), qi, si in zip(
            group, q.split(rows), scale.split(rows), strict=True
        ):
            b = None if lin.bias is None else lin.bias.detach().float()
            setattr(parent, attr, Int8Linear(qi, si, b))
    return module

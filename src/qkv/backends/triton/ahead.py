"""Compiling the kernels for a GPU without one: the check that the CUDA build works.

Triton compiles a kernel to PTX and ptxas turns it into machine code on any machine (both ship
in the ``triton`` wheel); only running it needs the GPU. :func:`compile_kernels` compiles the
three kernels for a problem exactly as a launch would specialise them (the same constexprs,
tiles, warps and stages, from :mod:`launch`) for an NVIDIA architecture (sm_90 = H100/H200),
and :func:`ptxas_report` reads registers, spills and whether the forward uses Hopper's wgmma.
tests/test_triton_compile.py runs it on CPU-only machines; benchmarks/triton_spills.py prints
the table that chose :func:`launch.gpu_tilings`.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from typing import Any

import torch

from ..._core.problem import Problem
from .launch import constexprs, gpu_tilings, heavy
from .lists import mask_spec

_TORCH_TO_TRITON = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Pointer arguments by kernel parameter name: "in" is q/k/v/dO's dtype, the rest fixed.
_POINTERS = {
    **dict.fromkeys(("Q", "K", "V", "DO"), "in"),
    **dict.fromkeys(("O", "DQ", "DK", "DV", "LSE", "DELTA", "SLOPES", "TABLE", "DPARAM"), "fp32"),
    **dict.fromkeys(("NUM", "IDX", "TAG", "START", "LIMIT", "IDS", "BITS"), "i32"),
}
_FLOATS = ("scale", "cap")


def _signature(
    fn: Any, consts: dict[str, Any], dtype: torch.dtype, bias: torch.dtype
) -> dict[str, str]:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "BIAS":
            sig[name] = "*" + _TORCH_TO_TRITON[bias]
        elif name in _POINTERS:
            kind = _POINTERS[name]
            sig[name] = "*" + (_TORCH_TO_TRITON[dtype] if kind == "in" else kind)
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_kernels(p: Problem, *, arch: int = 90, param_grad: bool = False) -> dict[str, Any]:
    """The forward, dK/dV and dQ kernels compiled for ``p`` on ``sm_{arch}``, by name."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import kernels

    spec = mask_spec(p.mask, p.B, p.Lq, p.Lk, torch.device("cpu"))
    t = gpu_tilings(max(p.D, p.Dv), p.dtype, heavy(p, spec))
    bias = p.score.bias.dtype if p.score.bias is not None else torch.float32
    pv_f32 = param_grad and p.dtype != torch.float32
    jobs = [
        ("attn_fwd", kernels.attn_fwd, t.fwd, {"DV": p.Dv, "PV_F32": pv_f32}),
        ("attn_bwd_dkdv", kernels.attn_bwd_dkdv, t.dkdv, {"DV_": p.Dv}),
        ("attn_bwd_dq", kernels.attn_bwd_dq, t.dq, {"DV_": p.Dv, "PARAM_GRAD": param_grad}),
    ]
    out = {}
    target = GPUTarget("cuda", arch, 32)
    for name, fn, tiling, extra in jobs:
        consts = {**constexprs(p, spec, tiling, interp=False), **extra}
        options = {"num_warps": consts.pop("num_warps"), "num_stages": consts.pop("num_stages")}
        src = ASTSource(fn=fn, signature=_signature(fn, consts, p.dtype, bias), constexprs=consts)
        out[name] = triton.compile(src, target=target, options=options)
    return out


def ptxas_report(compiled: Any, arch: int = 90) -> dict[str, Any]:
    """Registers, spill bytes and shared memory of one compiled kernel, from ptxas ``-v``."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [ptxas, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )

    def num(pattern: str) -> int:
        m = re.search(pattern, res.stderr)
        return int(m.group(1)) if m else 0

    return {
        "registers": num(r"Used (\d+) registers"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "shared": int(compiled.metadata.shared),
        "wgmma": "wgmma" in ptx,
    }


def variants() -> list[tuple[str, Problem, bool | int]]:
    """``(label, problem, param_grad)``: every dtype, the three head-dim tiers, each in-kernel
    mask term, bits, every score kind (with their tensors' gradients)."""
    from ... import masks, scores
    from ..._door import validate

    def problem(dtype: torch.dtype, d: int, mask: object, score: object = None) -> Problem:
        q = torch.empty(2, 8, 1000, d, dtype=dtype, device="meta")
        k = torch.empty(2, 2, 1000, d, dtype=dtype, device="meta")
        return validate(q, k, k, mask=mask, score_mod=score)

    ids = torch.arange(1000) // 300
    doc = masks.and_masks(masks.causal, masks.document(ids))
    pad = masks.padding(torch.tensor([1000, 700]), start=torch.tensor([0, 100]))
    table = torch.zeros(9, 8)
    bias = torch.empty(1, 8, 1000, 1000, dtype=torch.float16, device="meta")

    def dilated(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q - k) % 3 == 0

    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    return [
        ("bf16 d64 window", problem(bf16, 64, masks.sliding_window(128)), False),
        ("bf16 d128 window", problem(bf16, 128, masks.sliding_window(1024)), False),
        ("bf16 d128 doc-causal alibi", problem(bf16, 128, doc, scores.alibi(torch.ones(8))), True),
        ("bf16 d128 padding relative", problem(bf16, 128, pad, scores.relative_bias(table, 4)), 1),
        ("bf16 d256 causal softcap", problem(bf16, 256, masks.causal, scores.softcap(30.0)), False),
        ("fp16 d128 bits bias", problem(f16, 128, dilated, bias), True),
        ("fp32 d64 prefix", problem(f32, 64, masks.prefix_lm(100)), False),
        ("fp32 d111 window", problem(f32, 111, masks.sliding_window(64, 64)), False),
    ]


# Every dtype, every head-dim tier, all in-kernel mask terms but the prefix, bits, and every
# score kind but ALiBi with a gradient: what tests/test_triton_compile.py compiles.
QUICK = (
    "bf16 d64 window",
    "bf16 d128 padding relative",
    "bf16 d256 causal softcap",
    "fp16 d128 bits bias",
    "fp32 d111 window",
)


def main() -> None:
    """Print one JSON line per compiled kernel (``python -m qkv.backends.triton.ahead``)."""
    import json
    import sys

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    args = sys.argv[1:]
    quick = "--quick" in args  # one variant per head-dim tier and dtype (the test's run)
    arch = int(next((a for a in args if a.isdigit()), "90"))
    for label, p, param_grad in variants():
        if quick and label not in QUICK:
            continue
        for name, compiled in compile_kernels(p, arch=arch, param_grad=bool(param_grad)).items():
            row = {"variant": label, "kernel": name, **ptxas_report(compiled, arch)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

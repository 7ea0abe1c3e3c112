"""qkv's compiled CPU kernels: C++ built on first use with torch's extension builder.

Two operators from one source (``kernels/band.cpp``): ``band_forward`` and ``band_backward``,
the forward and backward of band masks (sliding windows) on float32 CPU tensors. They are an
accelerator, never a requirement: when they cannot be built (no C++ compiler,
``QKV_NATIVE=0``, a failed build) the block-sparse engine runs the same problem with torch's
fused kernel, and :func:`qkv.plan` says which one runs.

- Built once per (torch version, CPU capability) into ``$QKV_NATIVE_DIR`` (default
  ``~/.cache/qkv/native``); later processes load the cached library directly (a stamp of the
  source, flags and versions says it is current) in milliseconds. The first build takes
  ~15-30 s and says so on the ``qkv`` logger. ``python -m qkv.backends.blocksparse.native``
  builds it ahead of time.
- The compiler targets the CPU capability torch itself dispatches to (AVX512, AVX2 or plain),
  not ``-march=native``, so a cache shared between machines of one capability stays valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

Tensor = torch.Tensor

_SOURCE = Path(__file__).parent / "kernels" / "band.cpp"
_log = logging.getLogger("qkv")
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "op": the loaded operator, or "error": why there is none

_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def _capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older torch: no capability query; build portable code
        return "DEFAULT"


def cache_dir() -> Path:
    """Where the compiled kernels live: per torch version and CPU capability, then per build
    stamp, so that two checkouts or versions of qkv sharing one cache each keep their own
    library instead of rebuilding over each other's (seen with several worktrees here)."""
    root = os.environ.get("QKV_NATIVE_DIR") or Path.home() / ".cache" / "qkv" / "native"
    tag = f"torch-{torch.__version__.replace('+', '_')}-{_capability().lower()}"
    return Path(root) / tag / _stamp()


def _switched_off() -> bool:
    return os.environ.get("QKV_NATIVE", "1").strip().lower() in ("0", "off", "false", "no")


def disabled() -> str | None:
    """Why the compiled kernels will not be used (without building them), or ``None``."""
    if _switched_off():
        return "QKV_NATIVE=0 turns the compiled kernels off"
    if "error" in _state:
        return str(_state["error"])
    if "op" not in _state and shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found to build them (set CXX, or install g++)"
    return None


def _flags() -> list[str]:
    return ["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(_capability(), [])]


def _stamp() -> str:
    """What the library was built from: the source, the flags, torch and Python."""
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(repr((_flags(), torch.__version__, sys.version_info[:2])).encode())
    return h.hexdigest()[:20]


def _build() -> Any:
    """Load the library built for this source, or build it. A process whose library is
    already built loads it directly (~10 ms); going through torch's builder costs ~1 s and
    ~80 MiB of imports even when it finds nothing to do."""
    out = cache_dir()
    stamp_file = out / "stamp.json"
    try:
        got = json.loads(stamp_file.read_text())
        if got.get("stamp") == _stamp() and Path(got["lib"]).is_file():
            torch.ops.load_library(got["lib"])
            _register_fake()
            return torch.ops.qkv_native.band_forward
    except Exception:  # no stamp yet, a stale one, an unloadable file: build
        pass

    from torch.utils import cpp_extension

    out.mkdir(parents=True, exist_ok=True)
    # torch's builder runs `ninja`; the `ninja` package puts it beside the interpreter, which
    # is not on PATH when the venv is not activated.
    path = os.environ.get("PATH", "")
    extra = [str(Path(sys.executable).parent)]
    try:
        import ninja

        extra.append(str(ninja.BIN_DIR))
    except Exception:
        pass
    os.environ["PATH"] = os.pathsep.join([*extra, path])
    try:
        if not any(out.glob("qkv_native*.so")):
            _log.warning("qkv: compiling the CPU band kernel once (~15-30 s), into %s", out)
        cpp_extension.load(
            name="qkv_native",
            sources=[str(_SOURCE)],
            extra_cflags=_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(out),
            is_python_module=False,
            verbose=False,
        )
    finally:
        os.environ["PATH"] = path
    libs = sorted(out.glob("qkv_native*.so"), key=lambda f: f.stat().st_mtime)
    if libs:
        tmp = stamp_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stamp": _stamp(), "lib": str(libs[-1])}))
        tmp.replace(stamp_file)  # atomic: a concurrent reader sees the old or the new stamp
    _register_fake()
    return torch.ops.qkv_native.band_forward


def _register_fake() -> None:
    """Shapes without data (meta tensors, torch.compile's tracing)."""
    try:
        register = torch.library.register_fake
    except AttributeError:  # torch < 2.4 spelling; nothing to trace there
        return

    def fake(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        return out, q.new_empty(q.shape[:3])

    def fake_bwd(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    with contextlib.suppress(RuntimeError):  # already registered (a second load)
        register("qkv_native::band_forward", fake)
    with contextlib.suppress(RuntimeError):
        register("qkv_native::band_backward", fake_bwd)


def band_forward_op() -> Any | None:
    """The compiled band-forward operator, building it on first use; ``None`` (with the reason
    logged once, and in :func:`disabled`) when it cannot be had."""
    if _switched_off():
        return None
    op = _state.get("op")
    if op is not None:
        return op
    if torch.compiler.is_compiling():
        # file system, environment and a compiler: nothing for dynamo to trace. (Wrapped
        # here, not with a decorator: that would import torch._dynamo, ~1 s, with qkv.)
        if "load_eager" not in _state:
            _state["load_eager"] = torch.compiler.disable(_load)
        return _state["load_eager"]()
    return _load()


def _load() -> Any | None:
    if disabled() is not None:
        return None
    with _lock:
        if "op" in _state or "error" in _state:
            return _state.get("op")
        try:
            _state["op"] = _build()
        except Exception as e:  # no compiler, no headers, a failed build: fall back
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _state["error"] = f"building the compiled kernel failed: {first[:200]}"
            _log.warning("qkv: %s; using torch's fused kernel instead", _state["error"])
            return None
    return _state["op"]


# Tuned on a 2-core AVX512 VM (window 256, n=16384; benchmarks/RESULTS.md): 16-row query
# blocks (a block computes 16 + w - 1 keys per row for w useful), up to 32 blocks per task
# (one Kᵀ panel shared by 512 rows: each key transposed ~1.5 times). Within ~5% of each other:
# 32x4 68, 32x8 67, 16x16 65, 16x32 64, 24x12 62 ms (medians of 15 interleaved rounds).
BLOCK = 16
MAX_CHUNK = 32


def _chunk(blocks: int, per_thread: int) -> int:
    """Query blocks per task: enough tasks for every thread (``per_thread`` each), then as
    many blocks per task as allowed (the fewer tasks, the fewer Kᵀ panels)."""
    return max(1, min(MAX_CHUNK, blocks // (per_thread * torch.get_num_threads())))


def band_forward(
    q: Tensor, k: Tensor, v: Tensor, lo: int, hi: int, scale: float
) -> tuple[Tensor, Tensor]:
    """``out [B, Hq, Lq, Dv]`` and ``lse [B, Hq, Lq]`` (float32; zeros and ``-inf`` on rows
    that see no key) for the band ``lo <= k - q <= hi``. The planner calls this only after
    :func:`band_forward_op` returned the operator."""
    op = band_forward_op()
    if op is None:
        raise RuntimeError(f"qkv's compiled band kernel is unavailable: {disabled()}")
    chunk = _chunk(q.shape[0] * q.shape[1] * -(-q.shape[2] // BLOCK), per_thread=4)
    out, lse = op(q.contiguous(), k.contiguous(), v.contiguous(), lo, hi, scale, BLOCK, chunk)
    return out, lse


def band_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    dout: Tensor,
    lse_hi: Tensor,
    lse_lo: Tensor,
    dlse: Tensor | None,
    lo: int,
    hi: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` (float32) of :func:`band_forward`'s band, recomputed from its ``out``
    and lse (as float32 ``hi + lo`` parts of the float64 lse, rows without keys finite:
    ``grads.lse_hi_lo``) and the upstream ``dout`` and ``dlse`` (``None`` when
    nothing flowed into the lse)."""
    op = band_forward_op()
    if op is None:
        raise RuntimeError(f"qkv's compiled band kernel is unavailable: {disabled()}")
    d = q.new_empty(0) if dlse is None else dlse.float().contiguous()
    chunk = _chunk(q.shape[0] * k.shape[1] * -(-q.shape[2] // BLOCK), per_thread=8)
    grads: tuple[Tensor, Tensor, Tensor] = torch.ops.qkv_native.band_backward(
        *(t.contiguous() for t in (q, k, v, out, dout)),
        lse_hi.contiguous(),
        lse_lo.contiguous(),
        d,
        lo,
        hi,
        scale,
        BLOCK,
        chunk,
    )
    return grads


if __name__ == "__main__":  # build ahead of time: python -m qkv.backends.blocksparse.native
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    got = band_forward_op()
    print(f"qkv compiled kernels: {'ready in ' + str(cache_dir()) if got else disabled()}")
    sys.exit(0 if got is not None else 1)

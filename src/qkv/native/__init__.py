"""qkv's compiled CPU kernels: C++ libraries built on first use with torch's extension builder.

Each :class:`NativeLibrary` is one shared library of torch operators (its ``TORCH_LIBRARY``
namespace is the library's name) built from its own sources: the band kernel of the
block-sparse engine (``backends/blocksparse/native.py``) and the GGUF block kernels of the
decoder (``models/quantized.py``). They are accelerators, never requirements: when one cannot
be built (no C++ compiler, ``QKV_NATIVE=0``, a failed build) its caller runs the same problem
with torch's kernels and says which one runs.

- Built once per (torch version, CPU capability) into ``$QKV_NATIVE_DIR`` (default
  ``~/.cache/qkv/native``); later processes load the cached library directly (a stamp of the
  sources, flags and versions says it is current) in milliseconds. A first use that builds
  says so on stderr, before (~10-15 s a source) and after, once per library;
  ``QKV_QUIET_BUILD=1`` silences it. :func:`libraries` lists every library and ``qkv build``
  (:meth:`NativeLibrary.build` on each) builds them ahead, for a Dockerfile or a CI step;
  ``qkv.plan`` notes a kernel it would run that is not built yet.
- The compiler targets the CPU capability torch itself dispatches to (AVX512, AVX2 or plain),
  not ``-march=native``, so a cache shared between machines of one capability stays valid,
  and ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) builds and tests the other variants.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Built",
    "NativeLibrary",
    "build_all",
    "capability",
    "compiler",
    "libraries",
    "quiet_build",
    "switched_off",
]

_log = logging.getLogger("qkv")

# F16C (half -> float conversion) comes with every AVX2 and AVX-512 CPU; -mavx2 does not imply it.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


# qkv_cpu.h: the ISA defines and ATen includes every kernel source starts with.
_INCLUDE = Path(__file__).parent / "include"


def capability() -> str:
    """The CPU capability torch dispatches to: "AVX512", "AVX2" or "DEFAULT"."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older torch: no capability query; build portable code
        return "DEFAULT"


def switched_off() -> bool:
    """``QKV_NATIVE=0`` (or off/false/no) turns every compiled kernel off."""
    return os.environ.get("QKV_NATIVE", "1").strip().lower() in ("0", "off", "false", "no")


def quiet_build() -> bool:
    """``QKV_QUIET_BUILD=1`` (or on/true/yes) silences the lines a first-use build prints on
    stderr (the ``qkv`` logger still gets them, at INFO)."""
    return os.environ.get("QKV_QUIET_BUILD", "").strip().lower() in ("1", "on", "true", "yes")


def compiler() -> str | None:
    """The C++ compiler torch's builder would run (``$CXX``, else ``c++``), if there is one."""
    return shutil.which(os.environ.get("CXX", "c++"))


# Where qkv's libraries are defined, each as its module's ``LIBRARY``, in the order a user
# meets them: tests/test_native_build.py checks that every NativeLibrary in src/ is listed.
_DEFINED_IN = (
    "qkv.backends.blocksparse.native",  # the band kernel: sliding windows, small padding
    "qkv.backends.decode",  # the decode kernel: a few query rows against a KV cache
    "qkv.models.quantized",  # GGUF blocks: qkv.models' quantised decoders
)


def libraries() -> list[NativeLibrary]:
    """Every compiled library qkv uses on a CPU (importing the modules that define them)."""
    return [importlib.import_module(m).LIBRARY for m in _DEFINED_IN]


@dataclass(frozen=True)
class Built:
    """What :meth:`NativeLibrary.build` did: ``cached`` (found built, loaded) or built now in
    ``seconds``, into ``path``; or ``error``, why the library cannot be had, and ``detail``,
    the builder's whole message (the compiler's output) when a build failed."""

    name: str
    what: str
    cached: bool
    seconds: float
    path: str | None
    error: str | None = None
    detail: str | None = None


def build_all() -> list[Built]:
    """Build every library of :func:`libraries` that is not built yet for this CPU (what
    ``qkv build`` runs), one after the other."""
    return [lib.build() for lib in libraries()]


class NativeLibrary:
    """One compiled library: ``name`` (the shared object and the ``torch.ops`` namespace),
    its C++ ``sources``, extra compiler flags, a ``what`` for the log line, and ``fakes``
    (operator name -> shape function for meta tensors and torch.compile's tracing)."""

    def __init__(
        self,
        name: str,
        sources: Sequence[Path],
        *,
        what: str,
        extra_cflags: Sequence[str] = (),
        fakes: dict[str, Callable[..., Any]] | None = None,
    ) -> None:
        self.name = name
        self.sources = tuple(sources)
        self.what = what
        self.extra_cflags = tuple(extra_cflags)
        self.fakes = dict(fakes or {})
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {}  # "ops": the loaded namespace, or "error": why none
        self._announce = True  # a first-use build prints its lines; qkv build's does not

    # ----------------------------------------------------------------------- the build

    def flags(self) -> list[str]:
        return [
            "-O3",
            "-fopenmp",
            f"-I{_INCLUDE}",
            *_CAPABILITY_FLAGS.get(capability(), []),
            *self.extra_cflags,
        ]

    def stamp(self) -> str:
        """What the library was built from: the sources and qkv's shared headers, the flags,
        torch and Python. Not where the checkout lies (the ``-I`` flag's path): two clones of
        the same sources share one library rather than building it once each."""
        h = hashlib.sha256()
        for src in (*self.sources, *sorted(_INCLUDE.glob("*.h"))):
            h.update(src.read_bytes())
        flags = [f for f in self.flags() if not f.startswith("-I")]
        h.update(repr((flags, torch.__version__, sys.version_info[:2])).encode())
        return h.hexdigest()[:20]

    def cache_dir(self) -> Path:
        """Per torch version and CPU capability, then per build stamp, so that two checkouts
        or versions of qkv with other sources, sharing one cache, each keep their own library
        instead of rebuilding over each other's (seen with several worktrees here), and
        checkouts of the same sources share one."""
        root = os.environ.get("QKV_NATIVE_DIR") or Path.home() / ".cache" / "qkv" / "native"
        tag = f"torch-{torch.__version__.replace('+', '_')}-{capability().lower()}"
        return Path(root) / tag / self.stamp()

    def disabled(self) -> str | None:
        """Why the library will not be used (without building it), or ``None``. A library
        built already (by ``qkv build`` on an image that then dropped its compiler) loads
        without a compiler."""
        if switched_off():
            return "QKV_NATIVE=0 turns the compiled kernels off"
        if "error" in self._state:
            return str(self._state["error"])
        if "ops" not in self._state and compiler() is None:
            if "prebuilt" not in self._state:  # looked for once (a stamp: ~0.2 ms a look)
                self._state["prebuilt"] = self._built_lib() is not None
            if not self._state["prebuilt"]:
                return "no C++ compiler found to build them (set CXX, or install g++)"
        return None

    def built(self) -> bool:
        """True when the library is loaded in this process or built for these sources in the
        cache (a stamp check, no build and no load)."""
        return "ops" in self._state or self._built_lib() is not None

    def estimate(self) -> str:
        """How long a build takes, for a person: ~10-15 s a source (ATen's headers). Measured
        on a 2-core AMD EPYC (AVX-512): the band kernel 11.4 s, the decode kernel 9.7 s, the
        GGUF kernels' three sources 34.2 s."""
        n = len(self.sources)
        return f"~{10 * n}-{15 * n} s"

    def build(self) -> Built:
        """Build the library now if it is not built for this CPU, else load it; never raises
        (a failed build is ``Built.error``). What ``qkv build`` runs, so it prints nothing:
        the command says what happens."""
        why = self.disabled()
        if why is not None:
            return Built(self.name, self.what, False, 0.0, None, why)
        cached = self.built()
        start = time.perf_counter()
        ops = self._load(announce=False)
        seconds = time.perf_counter() - start
        if ops is None:
            why = self.disabled() or "the library was built but could not be loaded"
            detail = self._state.get("detail")
            return Built(self.name, self.what, False, seconds, None, why, detail)
        return Built(self.name, self.what, cached, seconds, self._built_lib())

    def ops(self) -> Any | None:
        """The library's ``torch.ops`` namespace, building it on first use; ``None`` (with
        the reason logged once, and in :meth:`disabled`) when it cannot be had."""
        if switched_off():
            return None
        got = self._state.get("ops")
        if got is not None:
            return got
        if torch.compiler.is_compiling():
            # file system, environment and a compiler: nothing for dynamo to trace. (Wrapped
            # here, not with a decorator: that would import torch._dynamo, ~1 s, with qkv.)
            if "load_eager" not in self._state:
                self._state["load_eager"] = torch.compiler.disable(self._load)
            return self._state["load_eager"]()
        return self._load()

    def ops_if_built(self) -> Any | None:
        """The library's namespace if it is loaded, or built already and loadable without a
        build (looked for once per process); ``None`` otherwise: for a caller to whom the
        library is a shortcut not worth a first build's ~15-30 s."""
        got = self._state.get("ops")
        if got is not None or switched_off() or torch.compiler.is_compiling():
            return got
        if "looked" not in self._state:
            self._state["looked"] = True
            if self._built_lib() is not None:
                return self._load()
        return None

    def _built_lib(self) -> str | None:
        """The path of the library built for these sources, if the cache's stamp says so."""
        try:
            got = json.loads((self.cache_dir() / "stamp.json").read_text())
            if got.get("stamp") == self.stamp() and Path(got["lib"]).is_file():
                return str(got["lib"])
        except (OSError, ValueError, KeyError, TypeError):  # no stamp yet, or a stale one
            pass
        return None

    def _load(self, *, announce: bool = True) -> Any | None:
        if self.disabled() is not None:
            return None
        with self._lock:
            if "ops" in self._state or "error" in self._state:
                return self._state.get("ops")
            try:
                # (an attribute, not an argument: tests replace _build with a failing stub)
                self._announce = announce
                self._state["ops"] = self._build()
            except Exception as e:  # no compiler, no headers, a failed build: fall back
                self._state["detail"] = str(e)  # the compiler's output, for qkv build
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                self._state["error"] = f"building the compiled kernel failed: {first[:200]}"
                # (qkv build reports its failures itself: no second line from the logger)
                level = logging.WARNING if announce else logging.INFO
                _log.log(level, "qkv: %s; using torch's kernels instead", self._state["error"])
                return None
        return self._state["ops"]

    def _build(self) -> Any:
        """Load the library built for these sources, or build it (saying so on stderr, unless
        :meth:`build` asked or :func:`quiet_build`). A process whose library is already built
        loads it directly (~10 ms); going through torch's builder costs ~1 s and ~80 MiB of
        imports even when it finds nothing to do."""
        out = self.cache_dir()
        stamp_file = out / "stamp.json"
        lib = self._built_lib()
        if lib is not None:
            try:
                torch.ops.load_library(lib)
                return self._registered()
            except Exception:  # an unloadable file: build
                pass

        from torch.utils import cpp_extension

        out.mkdir(parents=True, exist_ok=True)
        # torch's builder runs `ninja`; the `ninja` package puts it beside the interpreter,
        # which is not on PATH when the venv is not activated.
        path = os.environ.get("PATH", "")
        extra = [str(Path(sys.executable).parent)]
        try:
            import ninja

            extra.append(str(ninja.BIN_DIR))
        except Exception:
            pass
        os.environ["PATH"] = os.pathsep.join([*extra, path])
        # (a library file without a stamp is a build that stopped before its stamp: the
        # builder relinks nothing there, so that is no build worth announcing)
        compiles = not any(out.glob(f"{self.name}*.so"))
        start = time.perf_counter()
        if compiles:
            self._say(
                f"qkv: building the {self.what} for this CPU (first use, {self.estimate()}; "
                f"`qkv build` does this ahead) ..."
            )
        try:
            cpp_extension.load(
                name=self.name,
                sources=[str(s) for s in self.sources],
                extra_cflags=self.flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(out),
                is_python_module=False,
                verbose=False,
            )
        finally:
            os.environ["PATH"] = path
        libs = sorted(out.glob(f"{self.name}*.so"), key=lambda f: f.stat().st_mtime)
        if libs:
            tmp = stamp_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"stamp": self.stamp(), "lib": str(libs[-1])}))
            tmp.replace(stamp_file)  # atomic: a concurrent reader sees the old or the new stamp
        if compiles:
            took = time.perf_counter() - start
            self._say(f"qkv: built the {self.what} in {took:.1f} s, cached in {out}")
        return self._registered()

    def _say(self, line: str) -> None:
        """A first-use build's line: on stderr (a call stalls for seconds: the person waiting
        should see why), unless ``QKV_QUIET_BUILD=1``; on the ``qkv`` logger at INFO always."""
        _log.info("%s", line)
        if self._announce and not quiet_build():
            print(line, file=sys.stderr, flush=True)

    def _registered(self) -> Any:
        """The loaded namespace, with the shape functions registered (once)."""
        try:
            register = torch.library.register_fake
        except AttributeError:  # torch < 2.4 spelling; nothing to trace there
            register = None
        for op, fake in self.fakes.items():
            if register is not None:
                with contextlib.suppress(RuntimeError):  # already registered (a second load)
                    register(f"{self.name}::{op}", fake)
        return getattr(torch.ops, self.name)

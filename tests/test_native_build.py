"""Building qkv's compiled CPU kernels ahead and visibly: ``qkv build``, the first-use lines on
stderr (``QKV_QUIET_BUILD=1`` silences them) and ``qkv.plan``'s note on a kernel not built yet.

A real build takes ~10-15 s a source: the default run builds one small library (the decode
kernel) into a fresh cache; building every library from scratch is ``extended``. The lines
themselves are checked in-process against a stand-in for torch's builder.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv import native

# private: which module defines each library, and the libraries' load state, are the units
from qkv.backends.blocksparse import native as band
from qkv.backends.decode import LIBRARY as DECODE

SRC = Path(qkv.__file__).parent
_beside = Path(sys.executable).with_name("qkv")
QKV = str(_beside) if _beside.exists() else (shutil.which("qkv") or "qkv")

needs_compiler = pytest.mark.skipif(
    native.compiler() is None, reason="no C++ compiler to build qkv's CPU kernels"
)


def _qkv_build(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    # a first build of all three libraries takes ~1 min on 2 cores
    return subprocess.run(
        [QKV, "build", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )


def _lines(out: str) -> dict[str, str]:
    """``qkv build``'s line of each library, by library name."""
    names = {lib.name for lib in native.libraries()}
    got = {}
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in names:
            got[words[0]] = line
    return got


def test_every_compiled_library_is_listed() -> None:
    """``qkv build`` builds what qkv.native.libraries() lists: every NativeLibrary defined in
    src/ must be there (a new kernel left out would stall its first call unannounced by the
    command meant to prevent that)."""
    defined = set()
    for f in SRC.rglob("*.py"):
        if f.parent.name != "native" and re.search(
            r"^LIBRARY = NativeLibrary\(", f.read_text(), re.M
        ):
            rel = f.relative_to(SRC.parent).with_suffix("")
            defined.add(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    assert defined, "found no NativeLibrary definitions: the search is broken"
    assert defined == set(native._DEFINED_IN)
    libs = native.libraries()
    assert [lib.name for lib in libs] == ["qkv_native", "qkv_decode", "qkv_quant"]
    assert band.LIBRARY in libs and DECODE in libs


# ----------------------------------------------------------------- the lines, builder stubbed


def _stub_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[native.NativeLibrary, list[str]]:
    """A library whose "build" writes an empty file where torch's builder would put the shared
    object: the lines around a build, with no compiler run."""
    monkeypatch.setenv("QKV_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QKV_QUIET_BUILD", raising=False)
    src = tmp_path / "stub.cpp"
    src.write_text("// a stand-in source: only its bytes reach the stamp\n")
    builds: list[str] = []

    def load(*, name: str, build_directory: str, **kw: object) -> None:
        builds.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", load)
    return native.NativeLibrary("qkv_stub_test", [src], what="stub kernel"), builds


def test_a_first_use_build_says_so_once_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lib, builds = _stub_library(tmp_path, monkeypatch)
    assert not lib.built()
    assert lib.ops() is not None and lib.ops() is not None
    err = capsys.readouterr().err
    assert builds == ["qkv_stub_test"]
    before = "qkv: building the stub kernel for this CPU (first use, ~10-15 s; `qkv build`"
    assert err.count(before) == 1, err
    assert len(re.findall(r"qkv: built the stub kernel in \d+\.\d s, cached in ", err)) == 1, err
    assert err.index(before) < err.index("qkv: built the stub kernel in")
    assert lib.built()


def test_quiet_build_silences_the_lines(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    lib, builds = _stub_library(tmp_path, monkeypatch)
    monkeypatch.setenv("QKV_QUIET_BUILD", "1")
    with caplog.at_level(logging.INFO, logger="qkv"):
        assert lib.ops() is not None
    assert builds == ["qkv_stub_test"]  # it did build
    assert "stub kernel" not in capsys.readouterr().err
    assert any("building the stub kernel" in r.getMessage() for r in caplog.records)


def test_build_reports_instead_of_printing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """NativeLibrary.build (what qkv build runs) prints nothing: the command writes its own
    line from what it returns."""
    lib, builds = _stub_library(tmp_path, monkeypatch)
    got = lib.build()
    assert builds == ["qkv_stub_test"] and capsys.readouterr().err == ""
    assert (got.name, got.what, got.cached, got.error) == (
        "qkv_stub_test",
        "stub kernel",
        False,
        None,
    )
    assert got.path is not None and Path(got.path).name == "qkv_stub_test.so"
    assert lib.build().cached  # loaded now


@needs_compiler
def test_a_library_built_ahead_loads_without_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image that ran qkv build and then dropped its compiler still uses the kernels; an
    empty cache without a compiler says why not."""
    assert band.band_forward_op() is not None, band.disabled()  # built in the shared cache
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setattr(band.LIBRARY, "_state", {})  # as a new process
    assert band.disabled() is None and band.band_forward_op() is not None
    monkeypatch.setenv("QKV_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(band.LIBRARY, "_state", {})
    assert "no C++ compiler found" in str(band.disabled())


# ------------------------------------------------------------------------------- qkv.plan


def test_plan_notes_a_kernel_not_built_yet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty cache: the plan (which builds nothing) says the first call will build the
    kernel it runs, and builds nothing itself."""
    monkeypatch.setenv("QKV_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", sys.executable)  # a compiler as far as qkv looks: no build runs
    for lib in (band.LIBRARY, DECODE):
        monkeypatch.setattr(lib, "_state", {})  # as a new process: nothing loaded
    q = torch.randn(1, 2, 300, 16)
    window = qkv.plan(q, q, q, mask=qkv.sliding_window(40))
    assert window.backend == "blocksparse"
    note = (
        "qkv's CPU band kernel is not built yet: the first call builds it (~10-15 s, once for "
        "this CPU); `qkv build` builds it ahead"
    )
    assert note in window.notes and f"note: {note}" in str(window)
    step = qkv.plan(q[:, :, :1], q, q)
    assert step.backend == "decode"
    assert any(n.startswith("qkv's CPU decode kernel is not built yet") for n in step.notes)
    causal = qkv.plan(q, q, q, mask=qkv.causal)  # no compiled kernel: no note
    assert not any("not built yet" in n for n in causal.notes)
    assert not any(tmp_path.iterdir())  # the plan built nothing


@needs_compiler
def test_plan_has_no_note_once_built() -> None:
    assert band.band_forward_op() is not None, band.disabled()
    q = torch.randn(1, 2, 300, 16)
    assert not any(
        "not built yet" in n for n in qkv.plan(q, q, q, mask=qkv.sliding_window(40)).notes
    )


# ---------------------------------------------------------------------------- real builds


@pytest.mark.extended  # (a real build, ~10-30 s; the lines' logic: the stand-in tests above)
@needs_compiler
def test_first_decode_step_from_a_fresh_cache_announces_once(tmp_path: Path) -> None:
    """A new process, an empty cache: the plan notes the unbuilt decode kernel, the first step
    builds it with one line before and one after on stderr (none on stdout), the second step
    builds nothing, and the plan no longer notes it."""
    code = (
        "import torch, qkv\n"
        "q, k = torch.randn(1, 4, 1, 32), torch.randn(1, 4, 200, 32)\n"
        "print(any('decode kernel is not built yet' in n for n in qkv.plan(q, k, k).notes))\n"
        "out = qkv.attention(q, k, k); out = qkv.attention(q, k, k)\n"
        "print(qkv.plan(q, k, k).backend)\n"
        "print(any('not built yet' in n for n in qkv.plan(q, k, k).notes))\n"
    )
    env = {**os.environ, "QKV_NATIVE_DIR": str(tmp_path)}
    env.pop("QKV_QUIET_BUILD", None)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "decode", "False"]
    assert res.stderr.count("qkv: building the CPU decode kernel for this CPU (first use") == 1
    assert res.stderr.count("qkv: built the CPU decode kernel in") == 1
    assert res.stderr.count("qkv: ") == 2, res.stderr  # the band kernel was not built


@needs_compiler
def test_qkv_build_prints_a_line_per_library() -> None:
    """The cache the tests share (the libraries are built there once per machine anyway): one
    line per library, built or cached, with its file; exit status 0. Again: all cached."""
    for _ in range(2):
        res = _qkv_build()
        assert res.returncode == 0, res.stderr
        lines = _lines(res.stdout)
        assert set(lines) == {lib.name for lib in native.libraries()}, res.stdout
        for lib in native.libraries():
            line = lines[lib.name]
            assert lib.what in line and re.search(r"\b(built|cached) +\d+\.\d s ", line), line
            assert Path(line.split()[-1]).is_file(), line
    assert all(" cached " in line for line in lines.values()), res.stdout
    assert _qkv_build("--quiet").stdout == ""


def test_qkv_build_without_a_compiler_says_how_to_get_one(tmp_path: Path) -> None:
    res = _qkv_build(QKV_NATIVE_DIR=str(tmp_path), CXX=str(tmp_path / "no-such-c++"))
    assert res.returncode == 1 and res.stdout == ""
    assert "no C++ compiler found" in res.stderr and "apt-get install g++" in res.stderr
    assert "qkv still works without them, on torch's kernels" in res.stderr


def test_qkv_build_with_the_kernels_off_is_an_error() -> None:
    res = _qkv_build(QKV_NATIVE="0")
    assert res.returncode == 1 and "QKV_NATIVE=0 turns qkv's compiled kernels off" in res.stderr


def test_qkv_build_reports_a_failed_build(tmp_path: Path) -> None:
    """A compiler that fails: every library's line says FAILED, stderr says why, status 1."""
    bad = tmp_path / "bad-c++"
    bad.write_text("#!/bin/sh\necho 'c++: fatal error: deliberately broken' >&2\nexit 1\n")
    bad.chmod(0o755)
    res = _qkv_build(QKV_NATIVE_DIR=str(tmp_path / "cache"), CXX=str(bad))
    assert res.returncode == 1
    lines = _lines(res.stdout)
    assert len(lines) == 3 and all(line.rstrip().endswith("FAILED") for line in lines.values())
    assert "qkv build: error: CPU band kernel (qkv_native): building" in res.stderr
    assert "qkv still works without them" in res.stderr


@pytest.mark.extended
@needs_compiler
def test_qkv_build_from_scratch_then_a_first_window_builds_nothing(tmp_path: Path) -> None:
    """A fresh cache: qkv build builds every library (~1 min), and a first windowed call in a
    new process then loads the band kernel without a build (no line on stderr)."""
    res = _qkv_build(QKV_NATIVE_DIR=str(tmp_path))
    assert res.returncode == 0, res.stderr
    lines = _lines(res.stdout)
    assert len(lines) == 3 and all(" built " in line for line in lines.values()), res.stdout
    code = (
        "import torch, qkv\n"
        "q, w = torch.randn(1, 2, 1024, 32), qkv.sliding_window(64)\n"
        "assert not any('not built' in n for n in qkv.plan(q, q, q, mask=w).notes)\n"
        "qkv.attention(q, q, q, mask=w)\n"
        "print(qkv.plan(q, q, q, mask=w).forward)\n"
    )
    env = {**os.environ, "QKV_NATIVE_DIR": str(tmp_path)}
    env.pop("QKV_QUIET_BUILD", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert "compiled band kernel" in run.stdout and "qkv: build" not in run.stderr

"""The ``qkv`` console script, run as a user would (a subprocess of the installed command)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

# The console script installed next to this interpreter (the venv's bin/), else on PATH.
_beside = Path(sys.executable).with_name("qkv")
QKV = str(_beside) if _beside.exists() else (shutil.which("qkv") or "qkv")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([QKV, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_subcommands():
    r = run("--help")
    assert r.returncode == 0
    assert "walkthrough" in r.stdout and "plan" in r.stdout


def test_walkthrough_shows_shapes_sums_and_causal_zeros():
    r = run("walkthrough")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "X [4, 8] -> Q [4, 8], K [4, 8], V [4, 8]" in out
    assert "every row sums to 1: [1.0, 1.0, 1.0, 1.0]" in out
    assert "largest weight above the diagonal: 0.0" in out
    assert "score matrix is [3, 5], not square" in out
    assert "matches the formula" in out


def test_walkthrough_bad_arguments_exit_cleanly():
    r = run("walkthrough", "--dim", "7", "--heads", "2")
    assert r.returncode == 2
    assert "dim divisible by heads" in r.stderr and "Traceback" not in r.stderr


def test_plan_command_explains_its_choice():
    r = run("plan", "--mask", "causal", "--q-len", "512", "--heads", "8", "--kv-heads", "2")
    assert r.returncode == 0, r.stderr
    assert "backend 'sdpa'" in r.stdout and "Hq=8 Hkv=2" in r.stdout
    assert "density 50.1%" in r.stdout  # (512 * 513 / 2) / 512**2
    bad = run("plan", "--mask", "diagonal")
    assert bad.returncode == 2 and "unknown --mask 'diagonal'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_module_entry_point_matches_console_script():
    r = subprocess.run(
        [sys.executable, "-m", "qkv.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.startswith("qkv ")

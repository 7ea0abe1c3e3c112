"""``qkv build``: build qkv's compiled CPU kernels for this CPU ahead of their first use.

A first windowed call or decode step otherwise stalls for the ~10-15 s a kernel takes to
build; a Dockerfile or a CI step runs this once, and every later process loads the cached
libraries in milliseconds (:mod:`qkv.native`). One line per library on stdout; exit status
1 with the reason on stderr when a library cannot be built.
"""

from __future__ import annotations

import argparse
import sys

# How to get a C++ compiler, for the error line (qkv.native looks for $CXX, else c++).
_INSTALL = (
    "install one (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++; "
    "macOS: xcode-select --install) or point CXX at one"
)
_WITHOUT = "qkv still works without them, on torch's kernels (slower sliding windows and decode)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quiet", "-q", action="store_true", help="print nothing but errors (exit status 0 or 1)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import native

    libs = native.libraries()
    if native.switched_off():
        print(
            "qkv build: error: QKV_NATIVE=0 turns qkv's compiled kernels off, so there is "
            "nothing to build; unset it to build them",
            file=sys.stderr,
        )
        return 1
    todo = [lib for lib in libs if not lib.built()]
    if todo and native.compiler() is None:
        names = ", ".join(lib.what for lib in todo)
        print(
            f"qkv build: error: no C++ compiler found to build the {names} ($CXX, else c++ "
            f"on PATH): {_INSTALL}; {_WITHOUT}",
            file=sys.stderr,
        )
        return 1
    say = (lambda *a, **k: None) if args.quiet else print
    say(
        f"qkv build: {len(libs)} compiled CPU kernel libraries for this CPU "
        f"({native.capability()}, torch {torch.__version__}), {len(todo)} to build"
    )
    width = max(len(lib.what) for lib in libs)
    failed = []
    for lib in libs:
        say(f"  {lib.name:<10} {lib.what:<{width}}  ", end="", flush=True)
        got = lib.build()
        if got.error is not None:
            failed.append(got)
            say("FAILED")
            continue
        did = "cached" if got.cached else "built "
        say(f"{did} {got.seconds:6.1f} s  {got.path}")
    for got in failed:
        # the compiler's output beyond the error's first line (its last lines hold the error)
        more = (got.detail or "").strip().splitlines()[1:][-30:]
        print(
            f"qkv build: error: {got.what} ({got.name}): {got.error}"
            + "".join(f"\n    {line}" for line in more),
            file=sys.stderr,
        )
    if failed:
        print(f"qkv build: {_WITHOUT}", file=sys.stderr)
        return 1
    return 0

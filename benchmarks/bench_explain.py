"""``qkv explain`` start-up and run time: the whole process, against a bare ``import torch``.

Each command is started as a fresh process, in turn (A B C A B C ...), after one warm-up run
each; the script prints the median wall and CPU time (user + sys) of each and their ratios to
``import torch`` (the floor any torch CLI pays). On a shared machine the CPU time and the
ratios are the steadier figures. Target: ``qkv explain`` under 3 s on a 2-core machine.

Run (one benchmark at a time on a shared machine)::

    flock /tmp/qkv-bench.lock .venv/bin/python benchmarks/bench_explain.py --runs 7
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _time(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + sys, from the OS's accounting of the child)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    bin_dir = Path(sys.executable).parent
    out = Path(tempfile.mkdtemp(prefix="qkv-bench-explain-"))
    cmds = {
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "qkv explain": [str(bin_dir / "qkv"), "explain"],
        "qkv explain --png --html": [
            str(bin_dir / "qkv"),
            "explain",
            "--png",
            str(out / "a.png"),
            "--html",
            str(out / "a.html"),
        ],
    }
    for cmd in cmds.values():  # warm-up: file caches, matplotlib's font cache
        _time(cmd)
    wall: dict[str, list[float]] = {name: [] for name in cmds}
    cpu: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(args.runs):
        for name, cmd in cmds.items():
            w, c = _time(cmd)
            wall[name].append(w)
            cpu[name].append(c)
    base = "python -c 'import torch'"
    floor_w, floor_c = statistics.median(wall[base]), statistics.median(cpu[base])
    print(
        f"{'command':<26} {'wall median':>11} {'min':>5} {'max':>5} {'cpu median':>10} "
        f"{'wall / torch':>12} {'cpu / torch':>11}"
    )
    for name in cmds:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"{name:<26} {w:11.2f} {min(wall[name]):5.2f} {max(wall[name]):5.2f} {c:10.2f} "
            f"{w / floor_w:12.2f} {c / floor_c:11.2f}"
        )


if __name__ == "__main__":
    main()

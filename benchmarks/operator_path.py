"""What one pipeline would cost a small eager call today: qkv.attention's eager path against
the same call through the block-sparse engine's compile-time entry (the ``qkv::`` operators and
their spec, called eagerly), as an eager call would go if eager and compiled shared one path.

B=4 H=4 L=48 D=32 float32, sliding_window(8), forward, no gradient, 1 thread; the two run
interleaved, round by round, in one process; the figure is the median of per-round ratios.

    .venv/bin/python benchmarks/operator_path.py [--rounds 7] [--calls 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import qkv
from qkv._door import validate
from qkv.backends.blocksparse import compiled

sys.path.insert(0, os.path.dirname(__file__))
from machine import describe

B, H, L, D = 4, 4, 48, 32


def _per_call(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(describe())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
    mask = qkv.sliding_window(8)
    fns: dict[str, Callable[[], object]] = {
        "eager": lambda: qkv.attention(q, k, v, mask=mask, backend="blocksparse"),
        "operators": lambda: compiled.attention(validate(q, k, v, mask=mask))[0],
    }
    torch.testing.assert_close(fns["operators"](), fns["eager"]())
    for f in fns.values():
        _per_call(f, 200)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in fns}
    ratios = []
    for _ in range(args.rounds):
        for n, f in fns.items():
            times[n].append(_per_call(f, args.calls))
        ratios.append(times["operators"][-1] / times["eager"][-1])
    eager, ops = (statistics.median(times[n]) * 1e6 for n in ("eager", "operators"))
    print(
        f"B={B} H={H} L={L} D={D} sliding_window(8), 1 thread: eager {eager:.1f} us, "
        f"through the operators {ops:.1f} us; operators / eager {statistics.median(ratios):.2f}"
    )


if __name__ == "__main__":
    main()

"""``qkv.MultiHeadAttention(..., need_weights=True)``: forward and forward+backward time (ms,
median of 9 after a warm-up), causal, B=2, L=512, d_model=256, 8 heads, 2 threads.

    PYTHONPATH=src python benchmarks/bench_need_weights.py

Run it at two commits, alternating, to compare them (RESULTS.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import qkv


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(256, 8)
    x = torch.randn(2, 512, 256)  # [B, L, d_model]

    def fwd() -> None:
        with torch.no_grad():
            mha(x, mask=qkv.causal, need_weights=True)

    def fwdbwd() -> None:
        y, w = mha(x, mask=qkv.causal, need_weights=True)
        (y.sum() + w.sum()).backward()

    cases: tuple[tuple[str, Callable[[], None]], ...] = (("fwd", fwd), ("fwd+bwd", fwdbwd))
    for name, f in cases:
        f()
        ts = []
        for _ in range(9):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        print(f"{name} {statistics.median(ts) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

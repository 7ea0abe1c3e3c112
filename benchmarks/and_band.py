"""``and_masks(causal, sliding_window(w))`` against ``sliding_window(w)``: the same mask, and
(the engine plans an and-combination of bands as one band) the same kernel. Forward, medians
of a few calls after a warm-up.

    PYTHONPATH=src python benchmarks/and_band.py [--n 8192] [--heads 4] [--window 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import qkv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, a.heads, a.n, a.head_dim, generator=gen) for _ in range(3))
    masks = {
        f"and_masks(causal, sliding_window({a.window}))": qkv.and_masks(
            qkv.causal, qkv.sliding_window(a.window)
        ),
        f"sliding_window({a.window})": qkv.sliding_window(a.window),
    }
    for name, m in masks.items():
        qkv.attention(q, k, v, mask=m)  # warm-up (and the band kernel's first build)
        ts = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            qkv.attention(q, k, v, mask=m)
            ts.append(time.perf_counter() - t)
        kernel = qkv.plan(q, k, v, mask=m).forward.split(" (")[0]
        print(f"{name:40s} {statistics.median(ts) * 1e3:8.0f} ms  {kernel}")


if __name__ == "__main__":
    main()

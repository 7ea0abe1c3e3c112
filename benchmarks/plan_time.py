"""Time to plan built-in masks at block level (``qkv.block_mask``) at long lengths.

    python benchmarks/plan_time.py [--n 131072] [--threads 2] [--repeats 7]

Built-in masks are classified from their structure (no position is evaluated), so the cost
is O(number of tiles): 1024 x 1024 tiles at n = 131072 with 128-wide tiles.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    import torch

    import qkv

    torch.set_num_threads(a.threads)
    n = a.n
    gen = torch.Generator().manual_seed(0)
    ids = torch.sort(torch.randint(0, 8, (n,), generator=gen)).values
    masks = {
        "causal": qkv.causal,
        "sliding_window(255)": qkv.sliding_window(255),
        "and(causal, document 8 docs)": qkv.and_masks(qkv.causal, qkv.document(ids)),
        "prefix_lm(1024)": qkv.prefix_lm(1024),
        "padding (B=4)": qkv.padding(torch.tensor([n, n // 2, 10, 0])),
    }
    times: dict[str, list[float]] = {k: [] for k in masks}
    for _ in range(a.repeats):
        for name, m in masks.items():
            t = time.perf_counter()
            bm = qkv.block_mask(m, 4, 8, n, n)
            times[name].append(time.perf_counter() - t)
            assert not bm.evaluated
    print(f"n={n}, {a.threads} threads, default 128x128 tiles, median of {a.repeats}")
    for name, ts in times.items():
        print(f"  {name:<30} {statistics.median(ts) * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

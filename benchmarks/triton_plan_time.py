"""Host-side planning of one ``backend="triton"`` call at n = 32768 (B=1, H=16, D=128, bf16
tilings): the backend's ``route`` (mask formula, tile plan, block lists), on the CPU, no GPU
needed. Three consecutive calls per mask: the first plans, later ones find the plan kept by
value (bands) or on the mask object (masks holding tensors). Medians over ``--repeat`` fresh
mask objects.

    TRITON_INTERPRET=0 .venv/bin/python benchmarks/triton_plan_time.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "0"  # the GPU tilings (route never runs a kernel here)

import torch
from machine import describe

import qkv
from qkv._door import validate
from qkv.backends.triton import TritonBackend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n, backend = args.n, TritonBackend()
    q = torch.empty(1, 16, n, 128, dtype=torch.bfloat16, device="meta")
    cuts = (torch.linspace(0, 1, 9)[1:-1] ** 1.3 * n).long()
    ids = torch.bucketize(torch.arange(n), cuts)
    makers = {
        "sliding_window(w), a new w each time": lambda i: qkv.sliding_window(1000 + i),
        "causal within 8 documents": lambda i: qkv.and_masks(qkv.causal, qkv.document(ids)),
        "left + right padding": lambda i: qkv.padding(
            torch.tensor([n - 5 - i]), start=torch.tensor([3])
        ),
    }
    print(f"machine: {describe()}; n={n}")
    for name, make in makers.items():
        first, later = [], []
        for i in range(args.repeat):
            mask = make(i)
            times = []
            for _ in range(3):
                t = time.perf_counter()
                backend.route(validate(q, q, q, mask=mask))
                times.append((time.perf_counter() - t) * 1e3)
            first.append(times[0])
            later.append(statistics.median(times[1:]))
        print(
            f"{name}: first call {statistics.median(first):.2f} ms, "
            f"later calls {statistics.median(later):.2f} ms"
        )


if __name__ == "__main__":
    main()

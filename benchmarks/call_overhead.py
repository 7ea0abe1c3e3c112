"""What qkv adds to one small attention call: a GQA decode step (q [1, 9, 1, 64], 100 cached
keys, SmolLM2's head layout), where the kernel is tiny and Python is most of the time.

Pairs, interleaved round by round in one process, one thread, median of per-round ratios:
``qkv.attention`` against the bare ``F.scaled_dot_product_attention`` it routes to, and
``qkv.hf.attention_forward`` against transformers' ``sdpa_attention_forward`` (the call each
layer of a transformers model makes).

    .venv/bin/python benchmarks/call_overhead.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from machine import describe

from qkv import attention


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(200):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    q = torch.randn(1, 9, 1, 64)
    k, v = torch.randn(1, 3, 100, 64), torch.randn(1, 3, 100, 64)
    pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "qkv.attention vs F.sdpa": (
            lambda: attention(q, k, v),
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        )
    }
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        from qkv.hf import attention_forward

        class Layer(torch.nn.Module):
            is_causal = True
            num_key_value_groups = 3

        layer = Layer().eval()
        pairs["qkv.hf vs transformers sdpa"] = (
            lambda: attention_forward(layer, q, k, v, None, scaling=0.125),
            lambda: sdpa_attention_forward(layer, q, k, v, None, scaling=0.125),
        )
    except ImportError:
        print("transformers not installed: the qkv.hf pair is skipped")
    print(f"machine: {describe()}; 1 thread; {args.rounds} rounds x {args.calls} calls")
    for name, (ours, peer) in pairs.items():
        mine, theirs = [], []
        for _ in range(args.rounds):
            mine.append(per_call_us(ours, args.calls))
            theirs.append(per_call_us(peer, args.calls))
        ratio = statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
        print(
            f"{name}: {statistics.median(mine):.1f} us vs {statistics.median(theirs):.1f} us "
            f"a call; qkv / peer time {ratio:.2f}x"
        )


if __name__ == "__main__":
    main()

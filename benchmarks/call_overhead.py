"""One GQA decode-step attention call (q [1, 9, 1, 64] against k, v [1, 3, n, 64]: SmolLM2's
head layout), qkv against the calls people would otherwise make. At 100 cached keys the work
is tiny and per-call cost is most of the time; at thousands, the kernel is.

Pairs, interleaved round by round in one process, median of per-round ratios:
``qkv.attention`` against ``F.scaled_dot_product_attention(enable_gqa=True)``, and
``qkv.hf.attention_forward`` against transformers' ``sdpa_attention_forward`` (the call each
layer of a transformers model makes).

    .venv/bin/python benchmarks/call_overhead.py --rounds 7                 # 1 thread, 100 keys
    .venv/bin/python benchmarks/call_overhead.py --threads 2 --keys 32,100,400,1000,4000,16000

``--training`` times a small training-shaped call instead (q, k, v [4, 4, 48, 32] that need
gradients; forward alone, and forward + backward): ``qkv.attention`` (``backend="auto"``, which
reads a bound on the logits every such call) against ``backend="sdpa"`` and against
``F.scaled_dot_product_attention``.
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

import qkv
from qkv import attention


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(max(5, calls // 25)):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5000, help="calls per round at 100 keys")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keys", default="100", help="cached keys, comma-separated")
    ap.add_argument("--training", action="store_true", help="a small call that needs gradients")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {describe()}; {args.threads} thread(s); {args.rounds} rounds")
    if args.training:
        training(args.rounds, args.calls // 5)
        return
    for n in (int(x) for x in args.keys.split(",")):
        calls = max(20, args.calls * 100 // max(n, 100))  # ~the same time per round
        compare(n, args.rounds, calls)


def training(rounds: int, calls: int) -> None:
    q, k, v = (torch.randn(4, 4, 48, 32, requires_grad=True) for _ in range(3))

    def step(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: f().sum().backward()

    calls_of: dict[str, Callable[[], Any]] = {
        "auto": lambda: attention(q, k, v),
        "sdpa": lambda: attention(q, k, v, backend="sdpa"),
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
    }
    print(f"q, k, v [4, 4, 48, 32] needing gradients ({calls} calls a round)")
    print(f"  auto's plan: {qkv.plan(q, k, v).backend}")
    for what, wrap in (("forward", lambda f: f), ("forward + backward", step)):
        times: dict[str, list[float]] = {name: [] for name in calls_of}
        for _ in range(rounds):
            for name, f in calls_of.items():
                times[name].append(per_call_us(wrap(f), calls))
        m = {name: statistics.median(t) for name, t in times.items()}

        def ratio(a: str, b: str, times: dict[str, list[float]] = times) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

        print(
            f"  {what}: auto {m['auto']:.1f}, backend='sdpa' {m['sdpa']:.1f}, F.sdpa "
            f"{m['F.sdpa']:.1f} us a call; auto / sdpa {ratio('auto', 'sdpa'):.2f}x, "
            f"auto / F.sdpa {ratio('auto', 'F.sdpa'):.2f}x"
        )


def compare(n: int, rounds: int, calls: int) -> None:
    q = torch.randn(1, 9, 1, 64)
    k, v = torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64)
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
    backend = qkv.plan(q, k, v).backend
    print(f"{n} cached keys ({calls} calls a round; qkv's backend: {backend})")
    for name, (ours, peer) in pairs.items():
        mine, theirs = [], []
        for _ in range(rounds):
            mine.append(per_call_us(ours, calls))
            theirs.append(per_call_us(peer, calls))
        ratio = statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
        print(
            f"  {name}: {statistics.median(mine):.1f} us vs {statistics.median(theirs):.1f} us "
            f"a call; qkv / peer time {ratio:.2f}x"
        )


if __name__ == "__main__":
    main()

"""What the one pipeline costs an eager call: qkv.attention on the block-sparse engine (every
eager call through the registered ``qkv::blocksparse`` operators) in this checkout, against
the same calls in another checkout (``--against``: its ``src`` folder, e.g. a git worktree
of the commit before), run in alternating processes, round by round.

Cases, float32, 1 thread: a sliding window, a document mask and a user's score_mod at
B=4 H=4 L=48 D=32 (forward alone, and forward + backward), and a window at B=1 H=4 L=1024
D=64 (forward + backward). Each process times each case (the median of 3 repeats); the
figure is the median over rounds, and the ratio this / against.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/operator_path.py --against /tmp/before/src [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from machine import describe

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def _cases() -> dict[str, tuple[Callable[[], object], int]]:
    import qkv

    gen = torch.Generator().manual_seed(0)

    def qkv_(shape: tuple[int, ...], grad: bool) -> list[torch.Tensor]:
        return [torch.randn(shape, generator=gen).requires_grad_(grad) for _ in range(3)]

    small = (4, 4, 48, 32)
    docs = torch.tensor([0] * 20 + [1] * 28)
    tilt = torch.tensor(0.1, requires_grad=True)

    def score_mod(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + tilt * (i - j)

    def call(shape: tuple[int, ...], grad: bool, **kw: object) -> Callable[[], object]:
        q, k, v = qkv_(shape, grad)

        def run() -> object:
            out = qkv.attention(q, k, v, backend="blocksparse", **kw)  # type: ignore[arg-type]
            if grad:
                out.sum().backward()
            return out

        return run

    return {
        "window fwd": (call(small, False, mask=qkv.sliding_window(8)), 1000),
        "window fwd+bwd": (call(small, True, mask=qkv.sliding_window(8)), 300),
        "document fwd+bwd": (call(small, True, mask=qkv.document(docs)), 300),
        "score_mod fwd+bwd": (call(small, True, mask=qkv.causal, score_mod=score_mod), 200),
        "window L=1024 fwd+bwd": (
            call((1, 4, 1024, 64), True, mask=qkv.sliding_window(128)),
            10,
        ),
    }


def _child() -> None:
    torch.set_num_threads(1)
    res = {}
    for name, (fn, calls) in _cases().items():
        for _ in range(max(calls // 5, 3)):
            fn()
        reps = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            reps.append((time.perf_counter() - t0) / calls * 1e6)
        res[name] = statistics.median(reps)
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="the other checkout's src folder")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child()
        return
    print(describe())
    times: dict[str, dict[str, list[float]]] = {"this": {}, "against": {}}
    for _ in range(args.rounds):
        for who, src in (("against", args.against), ("this", HERE)):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            out = subprocess.run(
                [sys.executable, __file__, "--against", src, "--child"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for name, us in json.loads(out.splitlines()[-1]).items():
                times[who].setdefault(name, []).append(us)
    print(f"{'case':24s} {'against us':>11s} {'this us':>9s} {'this/against':>13s}")
    for name in times["this"]:
        a, t = statistics.median(times["against"][name]), statistics.median(times["this"][name])
        print(f"{name:24s} {a:11.1f} {t:9.1f} {t / a:13.3f}")


if __name__ == "__main__":
    main()

"""How many graphs torch.compile makes for one masked call over growing lengths.

    .venv/bin/python benchmarks/compile_lengths.py [--lengths 160 232 304 376] [--heads 8]

For each mask kind, forward (no gradient) and forward + backward, ``qkv.attention`` is
compiled once with ``fullgraph=True`` (``backend="aot_eager"``: traces what inductor would,
without code generation) and called at each length; the script prints the number of graphs
dynamo made (its frame count) and checks each result against eager. With the default lengths
at 8 heads the score grid crosses qkv's dense limit (2^20 scores) between 304 and 376.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-inductor-"))

import torch
import torch._dynamo.testing

import qkv

sys.path.insert(0, os.path.dirname(__file__))
from machine import describe

MASKS = {
    "window": lambda L: qkv.sliding_window(16),
    "causal": lambda L: qkv.causal,
    "prefix": lambda L: qkv.prefix_lm(32),
    "padding": lambda L: qkv.padding(torch.tensor([L - 5])),
    "document": lambda L: qkv.document(torch.arange(L) // 50),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[160, 232, 304, 376])
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()
    print(describe())
    print(f"B=1 H={args.heads} D=32, lengths {args.lengths}; graphs per mask (aot_eager)")
    for name, make in MASKS.items():
        counts = []
        for grad in (False, True):
            torch._dynamo.reset()
            counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
            f = torch.compile(
                lambda q, k, v, m: qkv.attention(q, k, v, mask=m), backend=counter, fullgraph=True
            )
            for L in args.lengths:
                q, k, v = (torch.randn(1, args.heads, L, 32, requires_grad=grad) for _ in range(3))
                m = make(L)
                out = f(q, k, v, m)
                torch.testing.assert_close(out, qkv.attention(q, k, v, mask=m))
                if grad:
                    out.sum().backward()
            counts.append(counter.frame_count)
        print(f"  {name:<9} forward {counts[0]}  forward+backward {counts[1]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

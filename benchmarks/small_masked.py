"""Small masked calls: qkv.attention against SDPA given the same mask as a dense bool tensor.

The shape of a layer in a small model (B=4, H=4, L=48, D=32) with a document, a padding, a
sliding-window mask and a user's mask_mod, each mask object reused across calls as a model's
layers reuse it. qkv and the peer run interleaved, round by round, in one process; each
figure is the median over rounds of the per-round ratio (qkv time / SDPA time), forward
only, no gradient.

    .venv/bin/python benchmarks/small_masked.py [--rounds 9] [--calls 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import qkv

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
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe())
    print(f"B={B} H={H} L={L} D={D} float32, {args.threads} thread(s), forward, no gradient")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
    idx = [torch.arange(n).view(*s) for n, s in ((B, (B, 1, 1, 1)), (H, (1, H, 1, 1)))]
    idx += [torch.arange(L).view(1, 1, L, 1), torch.arange(L).view(1, 1, 1, L)]
    masks = {
        "document": qkv.document(torch.arange(L) // 16),
        "padding": qkv.padding(torch.tensor([40, 48, 30, 20])),
        "window": qkv.sliding_window(8),
        # a user's mask_mod: its decision is kept, its mask evaluated at every call
        "mask_mod": lambda b, h, qi, ki: (qi // 16) == (ki // 16),
    }
    for name, mask in masks.items():
        dense = mask(*idx)  # the same mask as SDPA takes it: bool, broadcastable
        ours = lambda m=mask: qkv.attention(q, k, v, mask=m)  # noqa: E731
        peer = lambda d=dense: F.scaled_dot_product_attention(q, k, v, attn_mask=d)  # noqa: E731
        assert torch.allclose(ours(), peer(), atol=1e-5)
        for f in (ours, peer):
            _per_call(f, 50)  # warm-up (and the first, planning, call)
        ratios, a, b = [], [], []
        for _ in range(args.rounds):
            ta, tb = _per_call(ours, args.calls), _per_call(peer, args.calls)
            a.append(ta)
            b.append(tb)
            ratios.append(ta / tb)
        backend = qkv.plan(q, k, v, mask=mask).backend
        print(
            f"  {name:<9} qkv ({backend}) {statistics.median(a) * 1e6:6.0f} us  SDPA dense "
            f"{statistics.median(b) * 1e6:6.0f} us  ratio {statistics.median(ratios):.2f}"
        )


if __name__ == "__main__":
    main()

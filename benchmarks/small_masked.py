"""Small masked calls: qkv.attention against SDPA given the same mask as a dense bool tensor.

The shape of a layer in a small model (B=4, H=4, L=48, D=32) with a document, a padding, a
sliding-window mask and a user's mask_mod, each mask object reused across calls as a model's
layers reuse it, and (built-ins) made anew inside every call, as a model's ``forward`` writes
``mask=qkv.sliding_window(w)``: an equal mask is the same signature, so it must cost what the
kept one costs. qkv and the peer run interleaved, round by round, in one process; each
figure is the median over rounds of the per-round ratio (qkv time / SDPA time), forward
only, no gradient.

    .venv/bin/python benchmarks/small_masked.py [--rounds 9] [--calls 300] [--threads 1]
        [--shape B,H,L,D]

``--shape`` runs another shape (the padding lengths and documents scale with L: lengths
5/6, 1, 5/8 and 5/12 of L, documents of L/3 keys) to see where a route stops paying.
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

SHAPE = (4, 4, 48, 32)  # B, H, L, D


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
    ap.add_argument("--shape", default=",".join(map(str, SHAPE)), help="B,H,L,D")
    args = ap.parse_args()
    B, H, L, D = (int(x) for x in args.shape.split(","))
    if args.calls == ap.get_default("calls"):  # about the same time per round at any shape
        args.calls = max(3, 300 * SHAPE[0] * SHAPE[1] * SHAPE[2] ** 2 // (B * H * L * L))
    torch.set_num_threads(args.threads)
    print(describe())
    print(f"B={B} H={H} L={L} D={D} float32, {args.threads} thread(s), forward, no gradient")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
    idx = [torch.arange(n).view(*s) for n, s in ((B, (B, 1, 1, 1)), (H, (1, H, 1, 1)))]
    idx += [torch.arange(L).view(1, 1, L, 1), torch.arange(L).view(1, 1, 1, L)]
    ids = torch.arange(L) // max(1, L // 3)
    lengths = torch.tensor([L * f // 24 for f in (20, 24, 15, 10)] * B)[:B]
    # (name, the mask kept, the mask made anew at each call as a model's forward writes it)
    masks: list[tuple[str, object, Callable[[], object] | None]] = [
        ("document", qkv.document(ids), lambda: qkv.document(ids)),
        ("padding", qkv.padding(lengths), lambda: qkv.padding(lengths)),
        ("window", qkv.sliding_window(8), lambda: qkv.sliding_window(8)),
        # a user's mask_mod: its decision is kept, its mask evaluated at every call
        ("mask_mod", lambda b, h, qi, ki: (qi // 16) == (ki // 16), None),
    ]
    print(
        "  (ratios: medians over rounds of the per-round ratio; inline = the mask made in the call)"
    )
    for name, mask, make in masks:
        dense = mask(*idx)  # type: ignore[operator]  # the same mask as SDPA takes it
        fns: dict[str, Callable[[], object]] = {
            "kept": lambda m=mask: qkv.attention(q, k, v, mask=m),
            "sdpa": lambda d=dense: F.scaled_dot_product_attention(q, k, v, attn_mask=d),
        }
        if make is not None:
            fns["inline"] = lambda make=make: qkv.attention(q, k, v, mask=make())
        for f in fns.values():
            assert torch.allclose(f(), fns["sdpa"](), atol=1e-5)  # type: ignore[arg-type]
            _per_call(f, 50)  # warm-up (and the first, planning, call)
        times: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(args.rounds):
            for n, f in fns.items():
                times[n].append(_per_call(f, args.calls))

        def ratio(a: str, b: str, times: dict[str, list[float]] = times) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

        backend = qkv.plan(q, k, v, mask=mask).backend
        med = {n: statistics.median(t) * 1e6 for n, t in times.items()}
        line = (
            f"  {name:<9} qkv ({backend}) kept {med['kept']:6.0f} us  SDPA dense "
            f"{med['sdpa']:6.0f} us  kept/sdpa {ratio('kept', 'sdpa'):.2f}"
        )
        if "inline" in times:
            line += (
                f"  inline {med['inline']:6.0f} us  inline/kept {ratio('inline', 'kept'):.3f}"
                f"  inline/sdpa {ratio('inline', 'sdpa'):.2f}"
            )
        print(line)
        sys.stdout.flush()


if __name__ == "__main__":
    main()

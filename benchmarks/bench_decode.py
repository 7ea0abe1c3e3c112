"""Decode one token at a time against a KV cache: qkv.MultiHeadAttention vs plain PyTorch.

The peer is the least work a decode step can do in PyTorch: the four projections, an in-place
write of the new key/value into a preallocated cache, and one
``F.scaled_dot_product_attention`` call over the cached keys. qkv's step is
``mha(x, cache=cache, mask=qkv.causal)``. Both run under ``torch.no_grad()`` and are timed
interleaved (A B A B ...) in one process; each round decodes ``--steps`` tokens starting from a
cache of ``--context`` tokens (``KVCache.truncate`` rewinds it between rounds, so every step
sees ``context .. context + steps`` keys). We report the median per-token time of each and
the median of the per-round ratios. ``--window W`` also times a ``SlidingWindowCache(W)``
(already full, so each step attends to exactly W keys).

    python benchmarks/bench_decode.py                 # d_model 512, 8 heads, 4096 cached
    python benchmarks/bench_decode.py --profile       # where qkv's time goes (cProfile)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import qkv


def _plain_step(
    mha: qkv.MultiHeadAttention, x: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, n: int
) -> torch.Tensor:
    """One decode step in plain PyTorch with mha's weights: x [B, 1, d_model] at position n."""
    B, H, D = x.shape[0], mha.n_heads, mha.head_dim
    q = mha.q_proj(x).view(B, 1, H, D).transpose(1, 2)  # [B, H, 1, D]
    k = mha.k_proj(x).view(B, 1, H, D).transpose(1, 2)  # [B, H, 1, D]
    v = mha.v_proj(x).view(B, 1, H, D).transpose(1, 2)  # [B, H, 1, D]
    kbuf[:, :, n : n + 1].copy_(k)
    vbuf[:, :, n : n + 1].copy_(v)
    o = F.scaled_dot_product_attention(q, kbuf[:, :, : n + 1], vbuf[:, :, : n + 1])
    return mha.out_proj(o.transpose(1, 2).reshape(B, 1, H * D))  # [B, 1, d_model]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32, help="tokens decoded per round")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=0, help="also time a SlidingWindowCache")
    ap.add_argument("--profile", action="store_true", help="cProfile qkv's decode steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    d, H, ctx, steps = args.d_model, args.heads, args.context, args.steps
    mha = qkv.MultiHeadAttention(d, H).eval()
    B, D = 1, mha.head_dim
    prefix = torch.randn(B, ctx, d)
    xs = torch.randn(steps, B, 1, d)
    cache = qkv.KVCache(max_len=ctx + steps)
    assert args.window <= ctx, "the window must be full after the prefill"
    kbuf = torch.zeros(B, H, ctx + steps, D)
    vbuf = torch.zeros(B, H, ctx + steps, D)
    ring = qkv.SlidingWindowCache(args.window) if args.window else None

    with torch.no_grad():
        for i in range(0, ctx, 1024):  # prefill both caches with the same keys
            mha(prefix[:, i : i + 1024], cache=cache, mask=qkv.causal)
            if ring is not None:
                mha(prefix[:, i : i + 1024], cache=ring, mask=qkv.causal)
        kbuf[:, :, :ctx] = cache._k[:, :, :ctx]  # type: ignore[index]
        vbuf[:, :, :ctx] = cache._v[:, :, :ctx]  # type: ignore[index]

        def run_qkv() -> float:
            cache.truncate(ctx)  # rewind: every round decodes positions ctx .. ctx+steps-1
            t0 = time.perf_counter()
            for s in range(steps):
                mha(xs[s], cache=cache, mask=qkv.causal)
            return (time.perf_counter() - t0) / steps

        def run_plain() -> float:
            t0 = time.perf_counter()
            for s in range(steps):
                _plain_step(mha, xs[s], kbuf, vbuf, ctx + s)
            return (time.perf_counter() - t0) / steps

        def run_ring() -> float:
            assert ring is not None  # full already: the cost does not depend on the position
            t0 = time.perf_counter()
            for s in range(steps):
                mha(xs[s], cache=ring)
            return (time.perf_counter() - t0) / steps

        # Same numbers from both (the last step of a round attends to ctx + steps keys).
        cache.truncate(ctx)
        a = torch.cat([mha(xs[s], cache=cache, mask=qkv.causal) for s in range(steps)])
        b = torch.cat([_plain_step(mha, xs[s], kbuf, vbuf, ctx + s) for s in range(steps)])
        assert float((a - b).abs().max()) < 1e-5, float((a - b).abs().max())

        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                run_qkv()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
            return

        peers = {"qkv": run_qkv, "plain": run_plain}
        if ring is not None:
            peers[f"qkv ring w={args.window}"] = run_ring
        for f in peers.values():  # warm-up
            f()
        times: dict[str, list[float]] = {k: [] for k in peers}
        for _ in range(args.rounds):
            for k, f in peers.items():
                times[k].append(f())

    print(
        f"decode B={B} d_model={d} heads={H} head_dim={D} context={ctx} steps/round={steps} "
        f"rounds={args.rounds} threads={args.threads} torch {torch.__version__}"
    )
    print(f"{'peer':<22} {'median us/token':>16} {'ratio to plain (median)':>24}")
    for k, ts in times.items():
        ratios = [t / p for t, p in zip(ts, times["plain"], strict=True)]
        print(f"{k:<22} {statistics.median(ts) * 1e6:>16.1f} {statistics.median(ratios):>24.3f}")


if __name__ == "__main__":
    main()

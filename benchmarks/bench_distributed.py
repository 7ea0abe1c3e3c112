"""Context parallelism on this machine: 2 ranks x 1 thread (gloo over loopback) running
``qkv.distributed.attention`` vs one process on 2 threads running ``qkv.attention``.

For each mask (causal, sliding window) and layout, one run times, interleaved (dist, single,
dist, single, ...), the forward (and with ``--backward`` forward+backward) of both on the
same ``[B, H, n, D]`` problem, and reports per case:

- bytes each rank sent/received (counted by ``qd.traffic``, equal to ``qd.plan``'s) against
  an all-gather of K/V (torch's default context-parallel design: every rank receives all the
  keys it does not hold);
- the median wall time of the distributed call (the slowest rank, from a barrier) over the
  single-process call, and the median of the per-round ratios;
- overlap: the seconds a rank waited for messages inside the call, against the time the
  same messages take alone (``xfer``, measured by sending them with no compute): hidden =
  1 - wait / xfer.

    python benchmarks/bench_distributed.py                        # n = 32768, H 4, D 64
    python benchmarks/bench_distributed.py --n 4096 --rounds 3    # a quick look
    python benchmarks/bench_distributed.py --backward causal,window  # fwd+bwd for both
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qkv
import qkv.distributed as qd
from qkv.distributed.api import plan as _plan_fn
from qkv.distributed.checks import check_group
from qkv.distributed.compute import DEPTH, Spec, post_kv
from qkv.distributed.transport import Exchange

Tensor = torch.Tensor


def _mask(name: str, window: int) -> object:
    return qkv.causal if name == "causal" else qkv.sliding_window(window)


def _inputs(a: argparse.Namespace) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, a.heads, a.n, a.dim, generator=g) for _ in range(3))  # type: ignore[return-value]


def _xfer(layout: str, mask: object, k: Tensor, v: Tensor, a: argparse.Namespace) -> float:
    """The messages of one forward call sent and received with no compute between them."""
    rank, W = check_group(None)
    pl = _plan_fn(1, a.heads, a.n, a.dim, mask=mask, world_size=W, layout=layout)
    spec = Spec(None, rank, pl.layout, pl, None, None, 1.0, 0)  # type: ignore[arg-type]
    dist.barrier()
    t0 = time.perf_counter()
    ex = Exchange(None, "xfer")
    for st in pl.ranks[rank].steps[1:]:
        pending = post_kv(spec, ex, st, k, v, tag=st.index)
        if pending is not None:
            pending.wait()
    ex.finish()
    return time.perf_counter() - t0


def _worker(rank: int, W: int, port: int, a: argparse.Namespace, cmds: Any, res: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=W,
        timeout=timedelta(seconds=600),
    )
    q, k, v = _inputs(a)
    shards: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    while True:
        cmd = cmds.get()
        if cmd is None:
            break
        mask_name, layout, backward = cmd
        mask = _mask(mask_name, a.window)
        if layout not in shards:
            shards[layout] = tuple(qd.shard(t, layout=layout) for t in (q, k, v))  # type: ignore[assignment]
        ql, kl, vl = (t.detach().requires_grad_(backward) for t in shards[layout])
        xfer = _xfer(layout, mask, kl.detach(), vl.detach(), a)
        dist.barrier()
        with qd.traffic() as tr:
            t0 = time.perf_counter()
            out = qd.attention(ql, kl, vl, mask=mask, layout=layout)
            if backward:
                out.sum().backward()
            wall = time.perf_counter() - t0
        slowest = torch.tensor([wall])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        f_s, f_r = tr.total("forward")
        res.put(
            {
                "rank": rank,
                "wall": float(slowest),
                "wait": tr.wait_s,
                "compute": tr.compute_s,
                "xfer": xfer,
                "sent": f_s,
                "received": f_r,
                "bwd": tr.total("backward"),
                "grad_wait": tr.grad_wait_s,
            }
        )
    dist.destroy_process_group()


def _single(q: Tensor, k: Tensor, v: Tensor, mask: object, backward: bool) -> float:
    qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
    t0 = time.perf_counter()
    out = qkv.attention(qq, kk, vv, mask=mask)
    if backward:
        out.sum().backward()  # type: ignore[union-attr]
    return time.perf_counter() - t0


def project(a: argparse.Namespace) -> None:
    """What the plan's cost model says for a bigger problem across GPUs (NCCL): bytes per
    rank and step, FLOPs per rank, and the time of each at the bandwidth and throughput given
    (assumptions, not measurements)."""
    W, n, H, Hkv, D = a.world, a.n, a.heads, a.kv_heads or a.heads, a.dim
    link, flops = a.link_gbs * 1e9, a.tflops * 1e12
    head = f"projection: W={W} n={n} Hq={H} Hkv={Hkv} D={D} bf16"
    print(f"{head}; link {a.link_gbs} GB/s a rank, attention {a.tflops} TFLOP/s (assumed)")
    for mask_name in a.masks.split(","):
        for layout in a.layouts.split(","):
            m = _mask(mask_name, a.window)
            kw: dict[str, Any] = {"world_size": W, "layout": layout, "Hkv": Hkv}
            pl = qd.plan(1, H, n, D, mask=m, dtype=torch.bfloat16, **kw)
            worst = max(pl.ranks, key=lambda r: r.flops)
            recv = max(r.bytes_received for r in pl.ranks)
            row = Hkv * 2 * D * 2  # one position's K and V in bf16
            # Overlap as run_steps schedules it: the message of active step i is posted
            # DEPTH active steps ahead and arrives while those compute; the worst margin.
            exposed = 0.0
            for rp in pl.ranks:
                active = [st for st in rp.steps[1:] if st.recv or st.send]
                done = [rp.steps[0], *active]  # computed in this order
                for i, st in enumerate(active):
                    t_msg = sum(p.rows for p in st.recv) * row / link
                    cover = sum(c.flops for c in done[max(0, i + 1 - DEPTH) : i + 1]) / flops
                    exposed = max(exposed, t_msg - cover)
            biggest = max(sum(p.rows for p in st.recv) for rp in pl.ranks for st in rp.steps)
            name = mask_name if mask_name == "causal" else f"window {a.window}"
            mib, ms = 2**20, 1e3
            print(
                f"  {name}, {layout}: busiest rank {worst.flops / 1e12:.1f} TFLOP = "
                f"{worst.flops / flops * ms:.1f} ms, imbalance {pl.imbalance:.2f}; max received "
                f"{recv / mib:.0f} MiB/rank = {recv / link * ms:.2f} ms at the link (all-gather "
                f"{pl.allgather_bytes / mib:.0f} MiB = {pl.allgather_bytes / link * ms:.2f} ms); "
                f"largest message {biggest * row / mib:.0f} MiB = {biggest * row / link * ms:.2f}"
                f" ms; message time left uncovered by compute (worst step): "
                f"{max(0.0, exposed) * ms:.2f} ms"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layouts", default="zigzag,contiguous")
    ap.add_argument("--masks", default="causal,window")
    ap.add_argument("--backward", default="window", help="masks also timed forward+backward")
    ap.add_argument("--project", action="store_true", help="the plan's cost model only")
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--link-gbs", type=float, default=400.0, help="--project: GB/s per rank")
    ap.add_argument("--tflops", type=float, default=400.0, help="--project: attention TFLOP/s")
    a = ap.parse_args()
    if a.project:
        project(a)
        return
    torch.set_num_threads(a.world)  # the single process gets every core the ranks share
    W = a.world
    cases = [
        (m, lay, bwd)
        for m in a.masks.split(",")
        for lay in a.layouts.split(",")
        for bwd in ([False, True] if m in a.backward.split(",") else [False])
    ]
    ctx = mp.get_context("spawn")
    cmds = [ctx.Queue() for _ in range(W)]
    res = ctx.Queue()
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_worker, args=(r, W, port, a, cmds[r], res), daemon=True)
        for r in range(W)
    ]
    for p in procs:
        p.start()
    q, k, v = _inputs(a)
    got: dict[tuple[str, str, bool], dict[str, list[Any]]] = {
        c: {"dist": [], "single": [], "ranks": []} for c in cases
    }
    try:
        for rnd in range(a.rounds + 1):  # round 0 warms up (builds, caches) and is dropped
            for c in cases:
                for cq in cmds:
                    cq.put(c)
                ranks = sorted((res.get(timeout=900) for _ in range(W)), key=lambda d: d["rank"])
                t_single = _single(q, k, v, _mask(c[0], a.window), c[2])
                if rnd:
                    got[c]["dist"].append(ranks[0]["wall"])
                    got[c]["single"].append(t_single)
                    got[c]["ranks"].append(ranks)
    finally:
        for cq in cmds:
            cq.put(None)
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    report(a, got)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(a: argparse.Namespace, got: dict[tuple[str, str, bool], dict[str, list[Any]]]) -> None:
    W = a.world
    row_kv = a.heads * 2 * a.dim * 4  # one position's K and V, float32
    head = f"n={a.n} B=1 H={a.heads} D={a.dim} window={a.window}: {W} ranks x 1 thread"
    print(f"{head} (gloo, loopback) vs 1 process x {W} threads; medians of {a.rounds} rounds")
    med = statistics.median
    for (mask_name, layout, bwd), d in got.items():
        ratios = [x / y for x, y in zip(d["dist"], d["single"], strict=True)]
        last = d["ranks"][-1]
        lay = qd.Layout(layout, W, a.n)
        gather = (a.n - min(lay.lengths)) * row_kv
        what = "fwd+bwd" if bwd else "fwd"
        name = mask_name if mask_name == "causal" else f"window {a.window}"
        times = f"dist {med(d['dist']):.3f} s, single {med(d['single']):.3f} s"
        spread = f"per-round {min(ratios):.2f}-{max(ratios):.2f}"
        print(f"\n{name}, {layout}, {what}: {times}, ratio {med(ratios):.2f}x ({spread})")
        for r in range(W):
            wait = med(rs[r]["wait"] for rs in d["ranks"])
            xfer = med(rs[r]["xfer"] for rs in d["ranks"])
            comp = med(rs[r]["compute"] for rs in d["ranks"])
            gwait = med(rs[r]["grad_wait"] for rs in d["ranks"])
            hidden = max(0.0, 1 - wait / max(1e-9, xfer))
            moved = f"fwd sent {_mib(last[r]['sent'])}, received {_mib(last[r]['received'])}"
            bw = f"bwd sent/received {_mib(last[r]['bwd'][0])}/{_mib(last[r]['bwd'][1])}"
            ov = f"waited {wait * 1e3:.1f} ms for K/V that take {xfer * 1e3:.1f} ms alone"
            line = f"  rank {r}: {moved} (all-gather: {_mib(gather)}); {bw}; attention "
            line += f"{comp:.3f} s; {ov}: {hidden:.0%} hidden"
            if bwd:
                line += f"; waited {gwait * 1e3:.0f} ms for dK/dV"
            print(line)


if __name__ == "__main__":
    main()

"""``qkv bench``: time qkv.attention against torch's SDPA (and compiled FlexAttention) over
sequence lengths and masks, forward and forward+backward.

Peers run interleaved (A B C A B C ...) so that a drifting machine affects them alike; the
table reports medians, each peer's time relative to SDPA's in the same run, GFLOP/s counting
only the FLOPs of unmasked positions (4·B·H·D per visible pair forward, 2.5x that for the
backward), and the fraction of this machine's measured float32 matmul peak.

SDPA gets what a PyTorch user would give it: nothing for no mask, ``is_causal=True`` for
causal, and the mask as a dense ``[n, n]`` bool tensor otherwise (built before timing).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .bench_cases import MASKS, make_mask, make_peers

PEERS = ("qkv", "sdpa", "flex")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--masks", default="none,causal,window,document,prefix", help=", ".join(MASKS))
    p.add_argument("--peers", default="qkv,sdpa", help="qkv, sdpa, flex (compiled FlexAttention)")
    p.add_argument("--modes", default="fwd", help="fwd, fwdbwd or both (comma-separated)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--window", type=int, default=256, help="keys per query in 'window'")
    p.add_argument("--docs", type=int, default=8, help="documents in 'document' (causal)")
    p.add_argument("--prefix", type=int, default=1024, help="prefix length in 'prefix'")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per peer (median)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument(
        "--max-dense-gib",
        type=float,
        default=4.0,
        help="skip SDPA when its dense mask (bool + float copy) would exceed this",
    )
    p.add_argument("--png", default=None, help="write a plot of time vs length here")
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--no-progress", action="store_true")


# ------------------------------------------------------------------------------ problems


_PEAK_N = 2048


def matmul_peak(threads: int) -> float:
    """This machine's float32 matmul GFLOP/s (median of 5 2048² products)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(_PEAK_N, _PEAK_N), torch.randn(_PEAK_N, _PEAK_N)
    a @ b
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * _PEAK_N**3 / statistics.median(times) / 1e9


def _time(f: Callable[[], Any]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def time_interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Run every fn ``warmup`` times, then ``repeats`` rounds of A B C ...; seconds per run.
    A peer that raises is dropped with its error."""
    errors: dict[str, str] = {}
    live = dict(fns)
    first: dict[str, float] = {}
    for name, f in list(live.items()):
        for w in range(warmup):
            try:
                t = time.perf_counter()
                f()
                if w == 0:
                    first[name] = time.perf_counter() - t
            except Exception as e:  # a peer that cannot run this case
                errors[name] = f"{type(e).__name__}: {e}"[:200]
                del live[name]
                break
    times: dict[str, list[float]] = {n: [] for n in live}
    for _ in range(repeats):
        for name, f in live.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    for name, t0 in first.items():
        if name in times:
            times[name].insert(0, -t0)  # first (warm-up) call, negated: compile waits show
    return times, errors


@dataclass
class Row:
    n: int
    mask: str
    mode: str
    peer: str
    median_s: float
    first_s: float
    gflops: float
    peak_frac: float  # of the matmul peak measured around this case
    peak_gflops: float = 0.0  # that peak
    vs_sdpa: float | None = None  # peer time / SDPA time in the same run
    runs: list[float] = field(default_factory=list)


def bench_case(
    n: int,
    mask: str,
    mode: str,
    args: argparse.Namespace,
    peers: list[str],
    notes: list[str],
) -> list[Row]:
    import torch

    dtype = getattr(torch, args.dtype)
    spec = make_mask(mask, n, args)
    gen = torch.Generator().manual_seed(n)
    shape = (args.batch, args.heads, n, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    fns = make_peers(spec, n, args, peers, notes)
    flops = 4.0 * args.batch * args.heads * args.head_dim * spec.pairs
    if mode == "fwdbwd":
        flops *= 3.5  # forward + backward (2.5x the forward's matmul FLOPs)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        grad = torch.randn(args.batch, args.heads, n, args.head_dim, generator=gen).to(dtype)

        def step(f: Callable[..., Any]) -> Callable[[], Any]:
            def go() -> None:
                for t in (q, k, v):
                    t.grad = None
                f(q, k, v).backward(grad)

            return go

        runs = {name: step(f) for name, f in fns.items()}
    else:

        def fwd(f: Callable[..., Any]) -> Callable[[], Any]:
            def go() -> None:
                with torch.no_grad():
                    f(q, k, v)

            return go

        runs = {name: fwd(f) for name, f in fns.items()}
    # The matmul peak is measured again around each case (3 products just before its
    # rounds, 3 just after; median): this VM's clock and neighbours move it by +-15% within
    # a minute, so a peak taken at the start of a run can be minutes stale. Not between the
    # peers: after a 2048² product the BLAS threads keep spinning and slow the next small
    # call (SDPA at n=64 went from 84 to 260 us).
    mm = torch.randn(_PEAK_N, _PEAK_N, generator=gen)
    mm @ mm
    peaks = [_time(lambda: mm @ mm) for _ in range(3)]
    times, errors = time_interleaved(runs, args.repeats)
    peaks += [_time(lambda: mm @ mm) for _ in range(3)]
    case_peak = 2 * _PEAK_N**3 / statistics.median(peaks) / 1e9
    for name, err in errors.items():
        notes.append(f"{name} failed at n={n} {spec.name} {mode}: {err}")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        g = flops / med / 1e9
        frac = g / case_peak
        rows.append(Row(n, spec.name, mode, name, med, -ts[0], g, frac, case_peak, runs=ts[1:]))
    sdpa = next((r for r in rows if r.peer == "sdpa"), None)
    for r in rows:
        if sdpa is not None:
            # Ratios pair the runs of one round (A B A B ...), then take the median.
            pairs = [a / b for a, b in zip(r.runs, sdpa.runs, strict=True)]
            r.vs_sdpa = statistics.median(pairs)
    return rows


# ------------------------------------------------------------------------------ output


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'n':>7} {'mask':<14} {'mode':<7} {'peer':<5} {'median ms':>10} {'first ms':>9} "
        f"{'/sdpa':>7} {'sdpa/x':>7} {'GFLOP/s':>8} {'%peak':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "" if r.vs_sdpa is None else f"{r.vs_sdpa:.3f}"
        speed = "" if r.vs_sdpa in (None, 0) else f"{1 / r.vs_sdpa:.1f}x"
        lines.append(
            f"{r.n:>7} {r.mask:<14} {r.mode:<7} {r.peer:<5} {r.median_s * 1e3:>10.1f} "
            f"{r.first_s * 1e3:>9.0f} {ratio:>7} {speed:>7} {r.gflops:>8.1f} "
            f"{r.peak_frac:>6.0%}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--png needs matplotlib: pip install matplotlib") from e
    keys = sorted({(r.mask, r.mode) for r in rows})
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (mask, mode) in zip(axes.flat, keys, strict=False):
        for peer in sorted({r.peer for r in rows}):
            pts = sorted(
                (r.n, r.median_s) for r in rows if (r.mask, r.mode, r.peer) == (mask, mode, peer)
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=peer)
        ax.set(xscale="log", yscale="log", title=f"{mask} {mode}", xlabel="n", ylabel="s")
        ax.legend()
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled and sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if self.enabled or self.done == self.total:
            width = 28
            filled = int(width * self.done / max(1, self.total))
            bar = "#" * filled + "." * (width - filled)
            end = "\n" if self.done == self.total else ""
            print(f"\r[{bar}] {self.done}/{self.total} {what:<40}", end=end, file=sys.stderr)


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    import torch

    lengths = [int(x) for x in _csv(args.lengths)]
    masks = _csv(args.masks)
    for m in masks:
        if m not in MASKS:
            raise ValueError(f"unknown mask {m!r}; use {', '.join(MASKS)}")
    peers = _csv(args.peers)
    for p_ in peers:
        if p_ not in PEERS:
            raise ValueError(f"unknown peer {p_!r}; use {', '.join(PEERS)}")
    modes = ["fwd", "fwdbwd"] if args.modes == "both" else _csv(args.modes)
    torch.set_num_threads(args.threads)
    peak = matmul_peak(args.threads)
    print(
        f"qkv bench: torch {torch.__version__}, {args.threads} threads, B={args.batch} "
        f"H={args.heads} D={args.head_dim} {args.dtype}, matmul peak {peak:.0f} GFLOP/s at "
        f"the start (%peak: against matmuls timed around each case), median of "
        f"{args.repeats} interleaved runs"
    )
    cases = [(n, m, mode) for mode in modes for m in masks for n in lengths]
    progress = _Progress(len(cases), not args.no_progress)
    rows: list[Row] = []
    notes: list[str] = []
    for n, m, mode in cases:
        rows += bench_case(n, m, mode, args, peers, notes)
        progress.step(f"{m} n={n} {mode}")
    print(format_table(rows))
    for note in notes:
        print(f"note: {note}")
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak_gflops": peak, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0

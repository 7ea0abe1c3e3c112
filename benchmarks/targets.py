"""The block-sparse engine's targets, measured in one run against their peers.

    python benchmarks/targets.py [--repeats 5] [--threads 2] [--no-flex] [--json out.json]

Every row times its peers interleaved (A B A B ...) in this process and reports the median of
the per-round ratios. fp32, B=1, H=8, D=64 as in the issue. The memory row is
``benchmarks/memory.py`` (it needs fresh processes).
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace
from typing import Any

from qkv._cli.bench import _PEAK_N, bench_case, matmul_peak


def _args(repeats: int, threads: int) -> SimpleNamespace:
    return SimpleNamespace(
        batch=1,
        heads=8,
        head_dim=64,
        dtype="float32",
        window=256,
        docs=8,
        prefix=1024,
        repeats=repeats,
        threads=threads,
        max_dense_gib=8.0,
    )


# (label, n, mask, mode, peers, metric, target)
#   metric "x/sdpa": qkv time / SDPA time; "sdpa/x": SDPA time / qkv time;
#   "x/flex": qkv time / compiled FlexAttention's steady-state time.
TARGETS: list[tuple[str, int, str, str, list[str], str, float]] = [
    ("no mask, n=4096, fwd", 4096, "none", "fwd", ["qkv", "sdpa"], "x/sdpa", 1.05),
    ("causal, n=4096, fwd", 4096, "causal", "fwd", ["qkv", "sdpa"], "x/sdpa", 1.05),
    ("window 256, n=16384, fwd", 16384, "window", "fwd", ["qkv", "sdpa"], "sdpa/x", 20.0),
    (
        "causal + 8 documents, n=16384, fwd",
        16384,
        "document",
        "fwd",
        ["qkv", "sdpa"],
        "sdpa/x",
        6.0,
    ),
    ("causal, n=4096, fwd+bwd", 4096, "causal", "fwdbwd", ["qkv", "sdpa"], "x/sdpa", 1.2),
    ("window 256, n=4096, fwd+bwd", 4096, "window", "fwdbwd", ["qkv", "sdpa"], "sdpa/x", 8.0),
    (
        "FlexAttention compiled, window, n=4096, fwd",
        4096,
        "window",
        "fwd",
        ["qkv", "flex"],
        "x/flex",
        1.0,
    ),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention row")
    ap.add_argument("--only", default=None, help="run only rows whose label contains this")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    args = _args(a.repeats, a.threads)
    peak = matmul_peak(a.threads)
    print(
        f"torch {torch.__version__}, {a.threads} threads, fp32 B=1 H=8 D=64, matmul peak "
        f"{peak:.0f} GFLOP/s at the start; % of peak: against {_PEAK_N}² matmuls timed just "
        f"before and after each case's {a.repeats} interleaved rounds"
    )
    out: list[dict[str, Any]] = []
    for label, n, mask, mode, peers, metric, target in TARGETS:
        if a.no_flex and "flex" in peers:
            continue
        if a.only and a.only not in label:
            continue
        notes: list[str] = []
        rows = {r.peer: r for r in bench_case(n, mask, mode, args, peers, notes)}
        qkv_row = rows.get("qkv")
        other = rows.get("flex" if metric == "x/flex" else "sdpa")
        if qkv_row is None or other is None:
            print(f"{label}: could not run ({'; '.join(notes)})")
            continue
        pairs = [x / y for x, y in zip(qkv_row.runs, other.runs, strict=True)]
        pairs.sort()
        ratio = pairs[len(pairs) // 2]
        value = 1 / ratio if metric == "sdpa/x" else ratio
        ok = value >= target if metric == "sdpa/x" else value <= target
        bound = ">=" if metric == "sdpa/x" else "<="
        line = (
            f"{label:<44} {metric} = {value:7.3f} (target {bound} {target:g}) "
            f"{'MET' if ok else 'MISSED'} | qkv {qkv_row.median_s * 1e3:8.1f} ms "
            f"{qkv_row.gflops:6.1f} GFLOP/s ({qkv_row.peak_frac:.0%} of a "
            f"{qkv_row.peak_gflops:.0f} peak; {qkv_row.gflops / peak:.0%} of the start's) | "
            f"{other.peer} {other.median_s * 1e3:8.1f} ms"
        )
        if other.peer == "flex":
            line += f" (first call {other.first_s:.1f} s, qkv first call {qkv_row.first_s:.2f} s)"
        print(line)
        sys.stdout.flush()
        for note in notes:
            print(f"  note: {note}")
        out.append(
            {
                "label": label,
                "metric": metric,
                "value": value,
                "target": target,
                "met": ok,
                "qkv_ms": qkv_row.median_s * 1e3,
                "peer_ms": other.median_s * 1e3,
                "qkv_gflops": qkv_row.gflops,
                "qkv_peak_frac": qkv_row.peak_frac,
                "case_peak_gflops": qkv_row.peak_gflops,
                "qkv_start_peak_frac": qkv_row.gflops / peak,
                "peer_first_s": other.first_s,
            }
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"peak_gflops": peak, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory above the inputs for a sliding-window attention call, each case in a fresh
process (the operating system's peak resident set size is per process).

    python benchmarks/memory.py [--n 65536] [--window 256] [--threads 2]

Reports, per case, the peak RSS minus the RSS right after the inputs were created (and, for
fwd+bwd, after the upstream gradient and the first forward's output were allocated too: what
remains is the engine's own working memory plus its outputs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

_CHILD = "_child"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(n: int, window: int, mode: str, threads: int) -> None:
    import torch

    import qkv

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, generator=gen) for _ in range(3))
    mask = qkv.sliding_window(window - 1)
    if mode == "fwdbwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        grad = torch.randn(1, 8, n, 64, generator=gen)
    inputs = 4 * n * 8 * 64 * 4 / 2**20 if mode == "fwdbwd" else 3 * n * 8 * 64 * 4 / 2**20
    base = _rss_mib()
    peak_before = _peak_mib()
    if mode == "fwd":
        with torch.no_grad():
            out = qkv.attention(q, k, v, mask=mask)
    else:
        out = qkv.attention(q, k, v, mask=mask)
        out.backward(grad)
    peak = _peak_mib()
    outputs = out.numel() * 4 / 2**20 * (4 if mode == "fwdbwd" else 1)  # out (+ dq, dk, dv)
    print(
        json.dumps(
            {
                "n": n,
                "window": window,
                "mode": mode,
                "inputs_mib": round(inputs, 1),
                "outputs_mib": round(outputs, 1),
                "rss_after_inputs_mib": round(base, 1),
                "peak_above_inputs_mib": round(max(peak, peak_before) - base, 1),
                "dense_scores_gib": n * n * 8 * 4 / 2**30,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    for mode in ("fwd", "fwdbwd"):
        cmd = [sys.executable, __file__, _CHILD, str(a.n), str(a.window), mode, str(a.threads)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        print(
            f"window {r['window']}, n={r['n']}, {mode:<6}: peak "
            f"{r['peak_above_inputs_mib']:7.1f} MiB above the inputs ({r['inputs_mib']:.0f} MiB), "
            f"of which outputs "
            f"{r['outputs_mib']:.0f} MiB; dense scores would be {r['dense_scores_gib']:.0f} GiB"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    else:
        sys.exit(main())

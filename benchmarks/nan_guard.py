"""What keeping a NaN costs: qkv with its guard for torch's fused CPU kernel against qkv with
the guard switched off, interleaved in one process (median of per-round ratios).

    python benchmarks/nan_guard.py [--repeats 15] [--threads 2]

The guard (``qkv.backends.base.fused_cpu_mask``) gives a mask-free fused call over fewer than
16 keys a mask of zeros, so that the kernel's masked path keeps a NaN. The rows are
``benchmarks/targets.py``'s window and document figures (fp32, B=1, H=8, D=64; spans of
hundreds of keys: the guard should cost nothing there) and small calls whose key spans are
short (B=4, H=4, D=32: a whole call over 8 keys, 13-key documents), where it adds the mask;
those also show SDPA's time, the peer a small call is held to.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from machine import describe

import qkv
from qkv._cli.bench import time_interleaved
from qkv._cli.bench_cases import make_mask
from qkv.backends import sdpa as sdpa_backend

# (the package re-exports a function named forward: the module comes by its full name)
fwd_module = importlib.import_module("qkv.backends.blocksparse.forward")
_GUARDED = (fwd_module, sdpa_backend)
_REAL = fwd_module.fused_cpu_mask


def _unguarded(q: Any, lq: int, lk: int, mask: Any, causal: bool) -> tuple[Any, bool]:
    return mask, causal


def _with(guard: bool, f: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        for m in _GUARDED:
            m.fused_cpu_mask = _REAL if guard else _unguarded  # type: ignore[attr-defined]
        return f()

    return run


def _targets_row(n: int, mask: str, backward: bool) -> tuple[str, Callable[[], Any]]:
    args = SimpleNamespace(window=256, docs=8, prefix=1024)
    spec = make_mask(mask, n, args)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    if backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))

    def call() -> Any:
        out = qkv.attention(q, k, v, mask=spec.mod)
        if backward:
            out.sum().backward()
        return out

    label = f"{spec.name}, n={n}, {'fwd+bwd' if backward else 'fwd'}"
    return label, call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(
        f"{describe()}; {a.threads} threads; torch dispatches to "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )
    rows: list[tuple[str, Callable[[], Any], Callable[[], Any] | None]] = []
    for n, mask, bwd in (
        (16384, "window", False),
        (16384, "document", False),
        (4096, "window", True),
    ):
        label, call = _targets_row(n, mask, bwd)
        rows.append((label, call, None))
    g = torch.Generator().manual_seed(0)
    for L, name in ((8, "none"), (8, "causal"), (40, "document")):
        # inputs that need gradients (a training step's small call): the decode kernel, which
        # the guard does not touch, takes inference calls of a few rows
        q, k, v = (torch.randn(4, 4, L, 32, generator=g).requires_grad_() for _ in range(3))
        if name == "document":
            ids = torch.arange(L) * 3 // L  # 13-14 keys a document
            m: Any = qkv.document(ids)
            dense = ids[:, None] == ids[None, :]  # [L, L]
        else:
            m = qkv.causal if name == "causal" else None
            dense = None

        def small(q: Any = q, k: Any = k, v: Any = v, m: Any = m) -> Any:
            return qkv.attention(q, k, v, mask=m)

        def peer(
            q: Any = q, k: Any = k, v: Any = v, dense: Any = dense, causal: bool = name == "causal"
        ) -> Any:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, is_causal=causal)

        backend = qkv.plan(q, k, v, mask=m).backend
        rows.append((f"small {name}, B=4 H=4 L={L} D=32 ({backend})", small, peer))
    for label, call, peer in rows:
        fns = {"guard": _with(True, call), "no guard": _with(False, call)}
        if peer is not None:
            fns["sdpa"] = peer
        reps = a.repeats * (20 if peer is not None else 1)
        times, errors = time_interleaved(fns, reps, warmup=3)
        if errors:
            print(f"{label}: {errors}")
            continue
        ratios = sorted(
            x / y for x, y in zip(times["guard"][1:], times["no guard"][1:], strict=True)
        )
        med = sorted(times["guard"][1:])[len(ratios) // 2]
        line = (
            f"{label:<46} guard/no guard = {ratios[len(ratios) // 2]:.3f} "
            f"(guard {med * 1e3:.3f} ms)"
        )
        if "sdpa" in times:
            sd = sorted(x / y for x, y in zip(times["guard"][1:], times["sdpa"][1:], strict=True))
            line += f"; guard/sdpa = {sd[len(sd) // 2]:.3f}"
        print(line)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``qkv.scaled_dot_product_attention`` against ``torch.nn.functional.scaled_dot_product_attention``
on the same inputs and the same dense masks, in one run.

Cases: a causal bool mask and a banded bool mask (as a model builds them: ``tril``/``triu`` of
ones; qkv recognises them as ``qkv.causal`` / ``qkv.sliding_window``), no mask, and
``is_causal=True``. The mask tensor is kept across calls, as a model passes one mask to every
layer: qkv reads its values once (``qkv._sdpa_masks`` keeps the answer per tensor). The cost of
that one read is measured apart (``read``), against the dense call it replaces, at the sizes
around the threshold below which qkv does not read masks. Forward, or forward + backward with
``--backward``; timings interleaved A B A B, medians.

    PYTHONPATH=src python benchmarks/torch_sdpa.py [--n 4096] [--heads 8] [--window 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import qkv
from qkv import _sdpa_masks

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe

Tensor = torch.Tensor


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleaved(
    a: Callable[[], object], b: Callable[[], object], repeats: int
) -> tuple[float, float]:
    a(), b()  # warm-up (and qkv's one read of the mask, its plan, a kernel's first build)
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(_time(a))
        tb.append(_time(b))
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    a = ap.parse_args()
    print(describe())
    print(
        f"B={a.batch} H={a.heads} n={a.n} D={a.head_dim} float32, threads "
        f"{torch.get_num_threads()}, {'forward+backward' if a.backward else 'forward'}"
    )
    gen = torch.Generator().manual_seed(0)
    shape = (a.batch, a.heads, a.n, a.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_(a.backward) for _ in range(3))
    ones = torch.ones(a.n, a.n, dtype=torch.bool)
    cases: dict[str, dict[str, object]] = {
        "causal bool mask": {"attn_mask": ones.tril()},
        f"band bool mask (window {a.window})": {"attn_mask": ones.tril().triu(1 - a.window)},
        "no mask": {},
        "is_causal=True": {"is_causal": True},
    }

    def call(fn: Callable[..., Tensor], kw: dict[str, object]) -> Callable[[], object]:
        def run() -> object:
            out = fn(q, k, v, **kw)
            if a.backward:
                out.sum().backward()
            return out

        return run

    print(f"{'case':28s} {'torch ms':>9s} {'qkv ms':>9s} {'torch/qkv':>9s}  qkv runs")
    for name, kw in cases.items():
        t_torch, t_qkv = interleaved(
            call(F.scaled_dot_product_attention, kw),
            call(qkv.scaled_dot_product_attention, kw),
            a.repeats,
        )
        p = qkv.torch_sdpa.plan(q, k, v, **kw)  # type: ignore[arg-type]
        mask = str(p).split("mask    :")[1].splitlines()[0].strip()
        print(
            f"{name:28s} {t_torch * 1e3:9.1f} {t_qkv * 1e3:9.1f} {t_torch / t_qkv:9.2f}  "
            f"{p.backend}, mask {mask}"
        )

    print("\nreading a causal mask once (qkv._sdpa_masks) against one dense call of torch's")
    print(f"{'n':>6s} {'read ms':>9s} {'dense call ms':>14s} {'read/call':>9s}")
    for n in (128, 256, 512, 1024):
        m = torch.ones(1, 1, n, n, dtype=torch.bool).tril()
        qs = torch.randn(a.batch, a.heads, n, a.head_dim, generator=gen)
        t_read, t_call = interleaved(
            lambda m=m: _sdpa_masks._from_bool(m, 1),  # the read a new mask costs once
            lambda qs=qs, m=m: F.scaled_dot_product_attention(qs, qs, qs, attn_mask=m),
            max(a.repeats, 21),
        )
        print(f"{n:6d} {t_read * 1e3:9.3f} {t_call * 1e3:14.3f} {t_read / t_call:9.2f}")


if __name__ == "__main__":
    main()

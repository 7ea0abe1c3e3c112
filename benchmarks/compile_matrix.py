"""Which qkv.attention calls torch.compile can trace: fullgraph or not, graph breaks, time.

For every mask and score kind (and return_lse), at a length where ``auto`` may take SDPA with a
dense mask (200) and one where the block-sparse engine runs (1100), this script compiles
``qkv.attention`` forward + backward with ``backend="aot_eager"`` (traces what inductor would,
without code generation) and reports:

- ``fullgraph``: ``ok`` when ``torch.compile(fullgraph=True)`` traced it and the result equals
  eager (1e-5 relative), else the first line of the error;
- ``breaks``: graph breaks under the default compile (``torch._dynamo.explain``);
- ``compile s``: the wall time of the first fullgraph (or default) call.

``--dynamic`` compiles the fullgraph column with ``dynamic=True`` (every int and float the
call reads symbolic). ``--dense-limit BYTES`` runs the matrix under
``qkv.set_dense_limit(BYTES)``: with a small limit the calls the engine's operator cannot
take (a user's score_mod) trace as the plain formula in chunks of query rows.

With ``--inductor-window N`` it also compiles a sliding window's forward + backward at length
N with inductor (fullgraph=True) and reports the first compile's
time and the compiled / eager time ratio (medians of ``--rounds`` interleaved rounds).

Not a test (it measures where qkv stands; the compile tests assert what must hold). Run::

    .venv/bin/python benchmarks/compile_matrix.py [--lengths 200 1100] [--only window]
        [--dense-limit 4194304] [--dynamic] [--inductor-window 2048] [--rounds 9]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-inductor-"))

import torch
import torch._dynamo
from torch.nn.attention.flex_attention import create_block_mask

import qkv

sys.path.insert(0, os.path.dirname(__file__))
from machine import describe

B, H, HKV, D = 1, 4, 2, 32


def _cases(L: int, gen: torch.Generator) -> dict[str, dict[str, Any]]:
    ids = torch.arange(L) * 3 // L
    bias = torch.randn(1, H, L, L, generator=gen)
    table = torch.randn(2 * 16 + 1, H, generator=gen, requires_grad=True)
    tab = 0.1 * torch.randn(L, L, generator=gen)
    return {
        "none": {},
        "causal": {"mask": qkv.causal},
        "window": {"mask": qkv.sliding_window(32)},
        "prefix_lm": {"mask": qkv.prefix_lm(16)},
        "document": {"mask": qkv.document(ids)},
        "padding": {"mask": qkv.padding(torch.tensor([L - 5]))},
        "and": {"mask": qkv.and_masks(qkv.causal, qkv.document(ids))},
        "or": {"mask": qkv.or_masks(qkv.sliding_window(8), qkv.prefix_lm(4))},
        "bool": {"mask": torch.rand(L, L, generator=gen) > 0.3},
        "blockmask": {"mask": qkv.block_mask(qkv.causal, B, H, L, L)},
        "mask_mod": {"mask": lambda b, h, qi, ki: (qi - ki) % 3 == 0},
        "bias": {"score_mod": bias},
        "alibi": {"mask": qkv.causal, "score_mod": qkv.alibi(qkv.alibi_slopes(H))},
        "softcap": {"score_mod": qkv.softcap(20.0)},
        "relative": {"score_mod": qkv.relative_bias(table, 16)},
        "score_mod": {"score_mod": lambda s, b, h, qi, ki: s * 0.5},
        # FlexAttention's one-element convention: runs through torch.vmap
        "vmap_mod": {"score_mod": lambda s, b, h, qi, ki: s + tab[qi][ki]},
        "lse": {"mask": qkv.causal, "return_lse": True},
        # a FlexAttention BlockMask, as a model written for FlexAttention passes it
        "flex_bm": {"mask": create_block_mask(lambda b, h, qi, ki: ki <= qi, B, None, L, L, "cpu")},
    }


def _loss(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0].sum() + out[1].sum()
    return out.sum()


def _run(fn: Callable[..., Any], q, k, v, kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    loss = _loss(out)
    return loss.detach(), list(torch.autograd.grad(loss, leaves))


DYNAMIC: bool | None = None  # torch.compile's dynamic= (--dynamic sets True)


def _fullgraph(q, k, v, kw) -> tuple[str, float]:
    torch._dynamo.reset()
    want, wgrads = _run(qkv.attention, q, k, v, kw)
    f = torch.compile(qkv.attention, fullgraph=True, dynamic=DYNAMIC, backend="aot_eager")
    t0 = time.perf_counter()
    try:
        got, grads = _run(f, q, k, v, kw)
    except Exception as e:  # a report, not a test: every failure is a row of the table
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{type(e).__name__}: {first[:70]}", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    ok = all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip([got, *grads], [want, *wgrads], strict=True)
    )
    return ("ok" if ok else "DIFFERS from eager"), dt


def _breaks(q, k, v, kw) -> str:
    torch._dynamo.reset()
    try:
        ex = torch._dynamo.explain(qkv.attention)(q, k, v, **kw)
    except Exception as e:
        return f"explain failed: {type(e).__name__}"
    return str(ex.graph_break_count)


def _inductor_window(n: int, rounds: int) -> None:
    """Inductor's compile of a sliding window's forward + backward at length ``n`` against
    eager qkv, interleaved round by round: the first compile's time and the median of
    per-round ratios."""
    import statistics

    gen = torch.Generator().manual_seed(n)
    q = torch.randn(B, H, n, D, generator=gen)
    k = torch.randn(B, HKV, n, D, generator=gen)
    v = torch.randn(B, HKV, n, D, generator=gen)
    kw = {"mask": qkv.sliding_window(256)}
    torch._dynamo.reset()
    # fullgraph=True: the window is one graph (the default compile makes the same graph, and
    # in one process it would reuse this one's cache entry)
    fns = {"fullgraph": torch.compile(qkv.attention, fullgraph=True)}
    firsts = {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        _run(f, q, k, v, kw)
        firsts[name] = time.perf_counter() - t0
    _run(qkv.attention, q, k, v, kw)
    ratios: dict[str, list[float]] = {name: [] for name in fns}
    eager_times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        _run(qkv.attention, q, k, v, kw)
        te = time.perf_counter() - t0
        eager_times.append(te)
        for name, f in fns.items():
            t0 = time.perf_counter()
            _run(f, q, k, v, kw)
            ratios[name].append((time.perf_counter() - t0) / te)
    print(
        f"\ninductor, sliding_window(256), n={n}, fwd+bwd; eager median "
        f"{statistics.median(eager_times) * 1e3:.1f} ms; medians of {rounds} interleaved rounds"
    )
    for name in fns:
        print(
            f"  {name:<9}: first compile {firsts[name]:.1f} s; compiled / eager "
            f"{statistics.median(ratios[name]):.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[200, 1100])
    ap.add_argument("--only", nargs="*", default=None, help="case names to run")
    ap.add_argument("--inductor-window", type=int, default=0, help="also time inductor at N")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds of that timing")
    ap.add_argument("--dense-limit", type=int, default=0, help="qkv.set_dense_limit(BYTES)")
    ap.add_argument("--dynamic", action="store_true", help="fullgraph with dynamic=True")
    args = ap.parse_args()
    global DYNAMIC
    DYNAMIC = True if args.dynamic else None
    if args.dense_limit:
        qkv.set_dense_limit(args.dense_limit)
    warnings.filterwarnings("ignore")  # dynamo's advice per graph break: the table says it
    torch._logging.set_logs(dynamo=logging.ERROR)
    torch.manual_seed(0)
    print(describe())
    print(f"torch {torch.__version__}; B={B} H={H} Hkv={HKV} D={D}; backend aot_eager, fwd+bwd")
    if args.dynamic:
        print("fullgraph compiled with dynamic=True (breaks: the default compile, as always)")
    if args.dense_limit:
        print(f"dense limit {args.dense_limit} bytes")
    for L in args.lengths:
        gen = torch.Generator().manual_seed(L)
        q = torch.randn(B, H, L, D, generator=gen)
        k = torch.randn(B, HKV, L, D, generator=gen)
        v = torch.randn(B, HKV, L, D, generator=gen)
        cases = _cases(L, gen)
        traced = 0
        print(f"\nL = {L}")
        print(f"  {'case':<10} {'fullgraph':<80} {'breaks':>6} {'compile s':>9}")
        for name, kw in cases.items():
            if args.only and name not in args.only:
                continue
            status, dt = _fullgraph(q, k, v, kw)
            traced += status == "ok"
            print(f"  {name:<10} {status:<80} {_breaks(q, k, v, kw):>6} {dt:>9.1f}")
        print(f"  fullgraph traced and equal to eager: {traced} of {len(cases)}")
    if args.inductor_window:
        _inductor_window(args.inductor_window, args.rounds)


if __name__ == "__main__":
    main()

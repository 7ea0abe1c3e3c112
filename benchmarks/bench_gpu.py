"""qkv on one GPU against the kernels a CUDA user would otherwise call.

Cases (bf16, head dim 128, B=1, H=16 unless --smoke), each contender timed in the same
process, rounds interleaved, medians of per-round ratios:

- ``dense``: no mask and causal at n = 8k, 16k, 32k, forward and forward+backward, qkv's
  ``auto`` (which routes to SDPA) against SDPA pinned to its flash kernel;
- ``window``: sliding window 1024 at n = 32k, forward and forward+backward, qkv (``auto`` →
  ``triton``) against compiled FlexAttention (steady state) and SDPA with a dense bool mask;
  and achieved TFLOP/s on the useful FLOPs (4·B·H·D per visible pair) against the measured
  bf16 matmul peak;
- ``document``: causal within 8 documents at n = 32k against compiled FlexAttention, with a
  prebuilt ``qkv.block_mask`` (as FlexAttention's ``create_block_mask``) and without;
- ``first``: the first call of a new mask shape, in a warm process and in a fresh process
  with an empty Triton cache (compiling included), and FlexAttention's first call.

Writes ``results.json`` and ``results.md`` to ``--out``. Every case is guarded: an error is
recorded and the script goes on (GPU time is scarce; one broken case must not cost the rest).

    python benchmarks/bench_gpu.py --out gpu-results            # on the GPU (gpu_check.sh)
    TRITON_INTERPRET=1 python benchmarks/bench_gpu.py --smoke   # the script's logic on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import qkv

Tensor = torch.Tensor
RESULTS: dict[str, Any] = {"cases": {}, "errors": {}}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of one call over ``reps`` calls (CUDA events on a GPU)."""
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def race(contenders: dict[str, Callable[[], Any]], rounds: int, reps: int) -> dict[str, Any]:
    """Interleaved rounds: each round times every contender once (``reps`` calls, median).
    Returns per-contender median ms and, against the first contender ("qkv"), the median of
    per-round ratios peer_time / qkv_time (above 1: qkv is faster)."""
    for fn in contenders.values():  # warm-up (compiles, caches)
        fn()
        fn()
    sync()
    per: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            per[name].append(timed(fn, reps))
    first = next(iter(contenders))
    out: dict[str, Any] = {"ms": {n: statistics.median(v) for n, v in per.items()}}
    out["speedup"] = {
        n: statistics.median(p / q for p, q in zip(v, per[first], strict=True))
        for n, v in per.items()
        if n != first
    }
    return out


def guarded(name: str, fn: Callable[[], Any]) -> None:
    t = time.perf_counter()
    try:
        RESULTS["cases"][name] = fn()
        print(f"{name}: {json.dumps(RESULTS['cases'][name], default=str)}", flush=True)
    except Exception as e:  # record and go on: one case must not cost the rest of the run
        RESULTS["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
    print(f"  ({time.perf_counter() - t:.1f} s)", flush=True)


# ------------------------------------------------------------------------------ problems


def qkv_tensors(cfg: argparse.Namespace, n: int, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator(device=cfg.device).manual_seed(0)
    shape = (cfg.B, cfg.H, n, cfg.D)
    return tuple(  # type: ignore[return-value]
        torch.randn(shape, generator=g, device=cfg.device, dtype=cfg.dtype).requires_grad_(grad)
        for _ in range(3)
    )


def step(f: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, bwd: bool) -> Callable[[], Any]:
    """A closure running ``f(q, k, v)`` (and its backward with a fixed upstream gradient)."""
    if not bwd:

        def fwd() -> Any:
            with torch.no_grad():
                return f(q, k, v)

        return fwd
    dout = torch.randn((*q.shape[:-1], v.shape[-1]), device=q.device, dtype=q.dtype)

    def fwd_bwd() -> Any:
        q.grad = k.grad = v.grad = None
        f(q, k, v).backward(dout)

    return fwd_bwd


def flash(is_causal: bool) -> Callable[..., Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return f


def flex_compiled() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def window_mod(w: int) -> Callable[..., Tensor]:
    def mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (q >= k) & (q - k <= w)

    return mod


def peak_tflops(cfg: argparse.Namespace) -> float:
    n = 8192 if not cfg.smoke else 256
    a = torch.randn(n, n, device=cfg.device, dtype=cfg.dtype)
    b = torch.randn(n, n, device=cfg.device, dtype=cfg.dtype)
    ms = race({"mm": lambda: a @ b}, rounds=3, reps=10)["ms"]["mm"]
    return 2 * n**3 / (ms * 1e-3) / 1e12


# -------------------------------------------------------------------------------- cases


def case_dense(cfg: argparse.Namespace, n: int, causal: bool, bwd: bool) -> dict[str, Any]:
    q, k, v = qkv_tensors(cfg, n, bwd)
    mask = qkv.causal if causal else None
    plan = qkv.plan(q, k, v, mask=mask)
    res = race(
        {
            "qkv": step(lambda a, b, c: qkv.attention(a, b, c, mask=mask), q, k, v, bwd),
            "sdpa_flash": step(flash(causal), q, k, v, bwd),
        },
        cfg.rounds,
        cfg.reps,
    )
    res["qkv_backend"] = plan.backend
    res["target"] = ">= 0.95x SDPA flash (speedup['sdpa_flash'] >= 0.95)"
    return res


def case_window(cfg: argparse.Namespace, bwd: bool, peak: float | None) -> dict[str, Any]:
    n, w = cfg.n_long, cfg.window
    q, k, v = qkv_tensors(cfg, n, bwd)
    mask = qkv.sliding_window(w)
    be = cfg.masked_backend
    plan = qkv.plan(q, k, v, mask=mask, backend=be)
    contenders = {
        "qkv": step(lambda a, b, c: qkv.attention(a, b, c, mask=mask, backend=be), q, k, v, bwd)
    }
    if cfg.flex:
        from torch.nn.attention.flex_attention import create_block_mask

        flex = flex_compiled()
        bm = create_block_mask(window_mod(w), None, None, n, n, device=cfg.device)
        contenders["flex"] = step(lambda a, b, c: flex(a, b, c, block_mask=bm), q, k, v, bwd)
    if cfg.dense_peer:
        i = torch.arange(n, device=cfg.device)
        dense = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= w)  # [n, n] bool
        contenders["sdpa_dense_mask"] = step(
            lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense), q, k, v, bwd
        )
    res = race(contenders, cfg.rounds, cfg.reps)
    res["qkv_backend"] = plan.backend
    res["qkv_forward"] = plan.forward
    pairs = sum(min(i, w) + 1 for i in range(n))
    useful = 4 * cfg.B * cfg.H * cfg.D * pairs * (3.5 if bwd else 1.0)  # bwd: 2.5x the fwd
    res["useful_tflops_qkv"] = useful / (res["ms"]["qkv"] * 1e-3) / 1e12
    if peak:
        res["matmul_peak_tflops"] = peak
        res["share_of_peak"] = res["useful_tflops_qkv"] / peak
    res["target"] = ">= 1.0x compiled FlexAttention; >= 10x SDPA with a dense mask"
    return res


def case_document(cfg: argparse.Namespace, bwd: bool) -> dict[str, Any]:
    n, docs = cfg.n_long, 8
    q, k, v = qkv_tensors(cfg, n, bwd)
    # 8 documents of uneven lengths (sorted ids), as a packed batch has them
    cuts = torch.linspace(0, 1, docs + 1)[1:-1] ** 1.3 * n
    ids = torch.bucketize(torch.arange(n), cuts.long()).to(cfg.device)
    mask = qkv.and_masks(qkv.causal, qkv.document(ids))
    bm = qkv.block_mask(mask, None, None, n, n, device=cfg.device)
    be = cfg.masked_backend
    plan = qkv.plan(q, k, v, mask=bm, backend=be)
    contenders = {
        "qkv": step(lambda a, b, c: qkv.attention(a, b, c, mask=bm, backend=be), q, k, v, bwd),
        "qkv_mask_each_call": step(
            lambda a, b, c: qkv.attention(a, b, c, mask=mask, backend=be), q, k, v, bwd
        ),
    }
    if cfg.flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def doc_mod(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            return (ids[qi] == ids[ki]) & (qi >= ki)

        flex = flex_compiled()
        fbm = create_block_mask(doc_mod, None, None, n, n, device=cfg.device)
        contenders["flex"] = step(lambda a, b, c: flex(a, b, c, block_mask=fbm), q, k, v, bwd)
    res = race(contenders, cfg.rounds, cfg.reps)
    res["qkv_backend"] = plan.backend
    res["target"] = ">= 1.0x compiled FlexAttention"
    return res


_FIRST_CALL = """
import time, torch, qkv
dev = {device!r}
dt = getattr(torch, {dtype!r})
q, k, v = (torch.randn(1, {H}, {n}, {D}, device=dev, dtype=dt) for _ in range(3))
t = time.perf_counter()
qkv.attention(q, k, v, mask=qkv.sliding_window({w}), backend={be!r})
torch.cuda.synchronize() if dev == "cuda" else None
print(time.perf_counter() - t)
"""


def case_first_call(cfg: argparse.Namespace) -> dict[str, Any]:
    n, w = cfg.n_long - 1000, cfg.window + 77  # a length and window not seen before
    q, k, v = qkv_tensors(cfg, n, False)
    sync()
    t = time.perf_counter()
    qkv.attention(q, k, v, mask=qkv.sliding_window(w), backend=cfg.masked_backend)
    sync()
    res: dict[str, Any] = {"warm_process_s": time.perf_counter() - t}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        code = _FIRST_CALL.format(
            device=cfg.device,
            H=cfg.H,
            n=n,
            D=cfg.D,
            dtype=str(cfg.dtype).split(".")[1],
            w=w,
            be=cfg.masked_backend,
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        res["fresh_process_empty_triton_cache_s"] = (
            float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else out.stderr[-500:]
        )
    if cfg.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        sync()
        t = time.perf_counter()
        bm = create_block_mask(window_mod(w), None, None, n, n, device=cfg.device)
        flex(q, k, v, block_mask=bm)
        sync()
        res["flex_first_call_s"] = time.perf_counter() - t
    res["target"] = "< 3 s"
    return res


# --------------------------------------------------------------------------------- main


def report(cfg: argparse.Namespace) -> str:
    lines = [
        f"# qkv GPU benchmark ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"- machine: {RESULTS['machine']}",
        f"- command: `{' '.join(sys.argv)}`",
        f"- B={cfg.B} H={cfg.H} D={cfg.D} {str(cfg.dtype).split('.')[1]}, rounds {cfg.rounds} x "
        f"{cfg.reps} calls, medians of per-round ratios (peer time / qkv time: above 1, qkv "
        "faster)",
        "",
        "| case | qkv ms | peers ms | speedup vs peers | notes |",
        "|---|---|---|---|---|",
    ]
    for name, r in RESULTS["cases"].items():
        if "ms" not in r:
            lines.append(f"| {name} | | | | {json.dumps(r, default=str)} |")
            continue
        peers = {k: v for k, v in r["ms"].items() if k != "qkv"}
        notes = {k: v for k, v in r.items() if k not in ("ms", "speedup")}
        lines.append(
            f"| {name} | {r['ms']['qkv']:.3f} | "
            + ", ".join(f"{k} {v:.3f}" for k, v in peers.items())
            + " | "
            + ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup"].items())
            + f" | {json.dumps(notes, default=str)} |"
        )
    for name, err in RESULTS["errors"].items():
        lines.append(f"| {name} | FAILED | | | {err.splitlines()[0]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="gpu-results")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", default="dense,window,document,first")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any device (checks logic)")
    cfg = ap.parse_args()
    cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg.dtype = torch.bfloat16 if cfg.device == "cuda" else torch.float32
    cfg.B, cfg.H, cfg.D = (1, 16, 128) if not cfg.smoke else (1, 2, 32)
    cfg.ns = [8192, 16384, 32768] if not cfg.smoke else [256]
    cfg.n_long, cfg.window = (32768, 1024) if not cfg.smoke else (1100, 64)
    cfg.flex = cfg.device == "cuda"  # compiled FlexAttention needs the GPU to be a fair peer
    cfg.dense_peer = True
    # what qkv runs masks on: auto (triton on a GPU); the smoke run names triton (interpreter)
    cfg.masked_backend = "auto" if cfg.device == "cuda" else "triton"
    if cfg.smoke:
        cfg.rounds, cfg.reps = 1, 1
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    name = torch.cuda.get_device_name() if cfg.device == "cuda" else "CPU (smoke run)"
    RESULTS["machine"] = f"{name}, torch {torch.__version__}, triton {triton.__version__}"
    print(RESULTS["machine"], flush=True)
    only = set(cfg.only.split(","))
    peak = None
    if "window" in only:
        try:
            peak = peak_tflops(cfg)
            RESULTS["matmul_peak_tflops"] = peak
            print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
        except Exception as e:
            RESULTS["errors"]["peak"] = repr(e)

    def save() -> None:
        (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        (out / "results.md").write_text(report(cfg))

    if "window" in only:
        for bwd in (False, True):
            guarded(f"window{cfg.window}-n{cfg.n_long}-{'fwd+bwd' if bwd else 'fwd'}",
                    lambda bwd=bwd: case_window(cfg, bwd, peak))  # fmt: skip
            save()
    if "document" in only:
        for bwd in (False, True):
            guarded(f"document8-causal-n{cfg.n_long}-{'fwd+bwd' if bwd else 'fwd'}",
                    lambda bwd=bwd: case_document(cfg, bwd))  # fmt: skip
            save()
    if "dense" in only:
        for n in cfg.ns:
            for causal in (False, True):
                for bwd in (False, True):
                    label = f"{'causal' if causal else 'nomask'}-n{n}-{'fwd+bwd' if bwd else 'fwd'}"
                    guarded(label, lambda n=n, c=causal, b=bwd: case_dense(cfg, n, c, b))
                    save()
    if "first" in only:
        guarded("first-call-new-mask-shape", lambda: case_first_call(cfg))
        save()
    save()
    print(report(cfg))


if __name__ == "__main__":
    main()

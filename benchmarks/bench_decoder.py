"""SmolLM2-135M-Instruct on qkv (``qkv.models.load("smollm2")``) against transformers reading
the same GGUF file with ``attn_implementation="sdpa"``, in one process, the two
interleaved round by round, medians of the per-round ratios:

- ``load``: ``qkv.models.load("smollm2")`` (in this process, after a first warm-up load),
  and one transformers GGUF load; plus where qkv's load time goes (header, dequantisation,
  tokenizer, module construction).
- ``decode``: greedy decoding, batch 1, 128 new tokens after a 32-token prompt: tokens/s
  (new tokens / wall time, prefill included), and the decode-only rate.
- ``prefill``: one forward of 1024 tokens that fills the KV cache and returns the last
  position's logits (qkv: ``last_only=True``; transformers: ``logits_to_keep=1``).

    python benchmarks/bench_decoder.py                     # all three, 2 threads
    python benchmarks/bench_decoder.py --only decode --rounds 3

``--peer llama.cpp`` measures qkv against llama.cpp instead (llama-cpp-python's ctypes
binding over a llama.cpp built from source; it is a benchmark-time peer only): the same
SmolLM2 Q4_1 GGUF file, the same prompt token ids, greedy, 64 and 256 new tokens after a 16-
and a 512-token prompt, at 1 and 2 threads, the two interleaved round by round. Prefill
tokens/s (prompt tokens / time to the first new token) and decode tokens/s (the other new
tokens / their time), llama.cpp's both as its own counters give them (``llama_perf_context``:
time inside ``llama_decode``) and as wall time through the binding (the argmax included); the
new tokens compared one by one.

    pip install llama-cpp-python   # builds llama.cpp with cmake; or a build on PYTHONPATH
    python benchmarks/bench_decoder.py --peer llama.cpp [--rounds 3]
    python benchmarks/bench_decoder.py --peer llama.cpp --prompts 16 --news 64  # one row
    python benchmarks/bench_decoder.py --peer llama.cpp --int8-activations  # llama.cpp's arithmetic
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from machine import describe, smollm2_gguf

import qkv.models

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from the "
    "presses used for wine"
)


def _peer() -> Any:
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _profile_load() -> None:
    """One load, step by step (the same steps as qkv.models' GGUF loader)."""
    from qkv.models._gguf import read_gguf
    from qkv.models._gguf_tokenizer import gguf_tokenizer
    from qkv.models._llama_weights import gguf_state_dict

    t = [time.perf_counter()]
    g = read_gguf(smollm2_gguf())
    t.append(time.perf_counter())
    tok = gguf_tokenizer(g.metadata, "x")
    t.append(time.perf_counter())
    m = qkv.models.load("smollm2")  # whole load again, to take the shapes from
    t.append(time.perf_counter())
    expected = {k: v.shape for k, v in m.decoder.named_parameters()}
    t.append(time.perf_counter())
    gguf_state_dict(g, m.config, expected)
    t.append(time.perf_counter())
    del tok
    print(
        f"    load steps: header+metadata {t[1] - t[0]:.2f} s, tokenizer {t[2] - t[1]:.2f} s, "
        f"dequantise + unpermute all tensors {t[5] - t[4]:.2f} s (whole load {t[3] - t[2]:.2f} s)"
    )


def load(args: argparse.Namespace) -> None:
    qkv.models.load("smollm2")  # warm: imports, page cache
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        qkv.models.load("smollm2")
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    _peer()
    peer_s = time.perf_counter() - t0
    print(f"load ({args.rounds} rounds of qkv, 1 of transformers)")
    print(f"    qkv.models.load('smollm2'): median {statistics.median(times):.2f} s "
          f"(min {min(times):.2f}, max {max(times):.2f})")  # fmt: skip
    print(f"    transformers GGUF load: {peer_s:.1f} s ({peer_s / statistics.median(times):.0f}x)")
    _profile_load()


def decode(args: argparse.Namespace) -> None:
    model = qkv.models.load("smollm2")
    peer = _peer()
    ids = model.tokenize(PROMPT).input_ids[:, :32]
    prompt = model.decode(ids[0].tolist())
    assert model.tokenize(prompt).input_ids.shape[1] == 32, "the prompt must be 32 tokens"
    n = args.new
    qkv_rate, peer_rate, qkv_decode = [], [], []
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=4)
        peer.generate(ids, max_new_tokens=4, do_sample=False)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=n)
            qkv_rate.append(model.last_stats.new_tokens / (time.perf_counter() - t0))
            qkv_decode.append(model.last_stats.decode_tokens_per_s)
            assert model.last_stats.new_tokens == n, "qkv stopped early (end token)"
            ours = model.last_tokens[0]
            t0 = time.perf_counter()
            out = peer.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            peer_rate.append(n / (time.perf_counter() - t0))
    same = out[0, 32:].tolist() == ours
    print(f"decode: greedy, batch 1, {n} new tokens after 32 ({args.rounds} rounds; same tokens "
          f"as transformers: {same})")  # fmt: skip
    print(f"    qkv {statistics.median(qkv_rate):.1f} tok/s (decode only "
          f"{statistics.median(qkv_decode):.1f}), transformers sdpa "
          f"{statistics.median(peer_rate):.1f} tok/s")  # fmt: skip
    print(f"    qkv / sdpa tokens/s: {_median_ratio(qkv_rate, peer_rate):.2f}x")
    print(f"    qkv's linear layers: {model.linear_path}")


def prefill(args: argparse.Namespace) -> None:
    model = qkv.models.load("smollm2")
    peer = _peer()
    L = args.prefill
    ids = torch.randint(100, 40000, (1, L), generator=torch.Generator().manual_seed(0))
    ours_s, peer_s = [], []
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            t0 = time.perf_counter()
            a = model(ids, caches=model.decoder.new_caches(L), last_only=True).logits
            t1 = time.perf_counter()
            b = peer(ids, use_cache=True, logits_to_keep=1).logits
            t2 = time.perf_counter()
            if r:  # round 0 warms up
                ours_s.append(t1 - t0)
                peer_s.append(t2 - t1)
    diff = (a - b).abs().max().item()
    print(f"prefill {L} tokens ({args.rounds} rounds; last logits max abs diff {diff:.1e})")
    print(f"    qkv {statistics.median(ours_s):.2f} s, transformers sdpa "
          f"{statistics.median(peer_s):.2f} s")  # fmt: skip
    print(f"    qkv / sdpa time: {_median_ratio(ours_s, peer_s):.2f}x")


class _LlamaCpp:
    """Greedy decoding on llama.cpp through llama-cpp-python, timed."""

    def __init__(self, threads: int, n_ctx: int) -> None:
        try:
            import llama_cpp
        except ImportError as e:
            raise SystemExit(
                f"--peer llama.cpp needs llama-cpp-python ({e}): `pip install llama-cpp-python` "
                f"(it builds llama.cpp with cmake), or a source build on PYTHONPATH"
            ) from None
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(
            str(smollm2_gguf()),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=512,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def _next(self) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(logits.argmax())

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], dict[str, float]]:
        """``n`` new tokens after ``ids``; times: prefill and decode, wall and native."""
        llm, lib = self.llm, self.lib
        llm.reset()
        lib.llama_perf_context_reset(llm._ctx.ctx)
        t0 = time.perf_counter()
        llm.eval(ids)
        out = [self._next()]
        t1 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([out[-1]])
            out.append(self._next())
        t2 = time.perf_counter()
        perf = lib.llama_perf_context(llm._ctx.ctx)
        assert perf.n_eval == n - 1, (perf.n_eval, n)
        return out, {
            "prefill": len(ids) / (t1 - t0),
            "decode": (n - 1) / (t2 - t1),
            "prefill_native": perf.n_p_eval / (perf.t_p_eval_ms / 1e3),
            "decode_native": perf.n_eval / (perf.t_eval_ms / 1e3),
        }


def _prompt_of(model: Any, n: int) -> tuple[str, list[int]]:
    """A prompt text of about ``n`` tokens and qkv's ids for it (what both models get)."""
    ids = model._ids(" ".join([PROMPT] * (n // 20 + 1)))[:n]
    text = model.decode(ids)
    return text, model._ids(text)


def llama_cpp_peer(args: argparse.Namespace) -> None:
    _LlamaCpp(1, n_ctx=64)  # fails here, before any output, where llama.cpp is missing
    model = qkv.models.load("smollm2")
    if args.int8_activations:
        model.quantize_activations()  # llama.cpp's arithmetic: 8-bit activations
    print(f"qkv's linear layers: {model.linear_path}")
    print(
        f"qkv vs llama.cpp: greedy, batch 1, {args.rounds} interleaved rounds, medians; "
        f"tokens/s (llama.cpp: its own counters / wall through the binding)"
    )
    print(
        "| threads | prompt | new | qkv prefill | llama.cpp prefill | qkv / llama.cpp "
        "| qkv decode | llama.cpp decode | qkv / llama.cpp | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads_list:
        torch.set_num_threads(threads)
        peer = _LlamaCpp(threads, n_ctx=1024)
        for length in args.prompts:
            text, ids = _prompt_of(model, length)
            for n in args.news:
                ours: dict[str, list[float]] = {"prefill": [], "decode": []}
                theirs: dict[str, list[float]] = {k: [] for k in _KEYS}
                with torch.inference_mode():
                    model.generate(text, max_new_tokens=4)  # warm-up
                    peer.greedy(ids, 4)
                    for _ in range(args.rounds):
                        model.generate(text, max_new_tokens=n)
                        st = model.last_stats
                        ours["prefill"].append(st.prompt_tokens_per_s)
                        ours["decode"].append(st.decode_tokens_per_s)
                        mine = model.last_tokens[0]
                        tokens, rates = peer.greedy(ids, n)
                        for k in _KEYS:
                            theirs[k].append(rates[k])
                assert st.prompt_tokens == len(ids), (st.prompt_tokens, len(ids))
                k = min(len(mine), len(tokens))
                first = next((i for i in range(k) if mine[i] != tokens[i]), None)
                same = (f"all {k}" if first is None else f"first {first} of {k} (then differ)") + (
                    "" if len(mine) == n else f"; qkv ended at {len(mine)}"
                )

                pre, dec = _cells(ours, theirs, "prefill"), _cells(ours, theirs, "decode")
                print(
                    f"| {threads} | {len(ids)} | {n} | "
                    f"{statistics.median(ours['prefill']):.0f} | {pre[0]} | {pre[1]} | "
                    f"{statistics.median(ours['decode']):.1f} | {dec[0]} | {dec[1]} | {same} |"
                )


_KEYS = ("prefill", "decode", "prefill_native", "decode_native")


def _cells(ours: dict, theirs: dict, kind: str) -> tuple[str, str]:
    """llama.cpp's rate (its counters / wall) and qkv's ratio to each, medians."""
    m = statistics.median
    return (
        f"{m(theirs[kind + '_native']):.0f} / {m(theirs[kind]):.0f}",
        f"{_median_ratio(ours[kind], theirs[kind + '_native']):.2f} / "
        f"{_median_ratio(ours[kind], theirs[kind]):.2f}",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", choices=["transformers", "llama.cpp"], default="transformers")
    ap.add_argument("--threads-list", type=int, nargs="+", default=[1, 2], help="llama.cpp")
    ap.add_argument("--prompts", type=int, nargs="+", default=[16, 512], help="llama.cpp")
    ap.add_argument("--news", type=int, nargs="+", default=[64, 256], help="llama.cpp")
    ap.add_argument(
        "--int8-activations",
        action="store_true",
        help="llama.cpp: qkv with model.quantize_activations() (default: the exact path)",
    )
    ap.add_argument("--only", choices=["load", "decode", "prefill"], action="append")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.peer == "llama.cpp":
        print(f"machine: {describe()}")
        llama_cpp_peer(args)
        return
    torch.set_num_threads(args.threads)
    print(f"machine: {describe()}; {args.threads} threads")
    for part in args.only or ["load", "decode", "prefill"]:
        {"load": load, "decode": decode, "prefill": prefill}[part](args)


if __name__ == "__main__":
    main()

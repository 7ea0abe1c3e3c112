"""qkv.models vs its peers on the packaged all-MiniLM-L6-v2, interleaved in one process.

- encode: ``qkv.models.load().encode(texts)`` vs ``SentenceTransformer(path).encode(texts)``
  on a small batch of mixed lengths (where qkv packs short texts into shared rows) and on a
  batch of equal lengths (nothing to pack); both return tensors.
- attention_maps: ``model.attention_maps(text)`` vs ``transformers.BertModel`` (eager attention,
  ``output_attentions=True``) including the tokenizer call.

Run (one benchmark at a time on a shared machine)::

    flock /tmp/qkv-bench.lock .venv/bin/python benchmarks/bench_models.py

Prints medians of interleaved repetitions (A B A B ...) and the ratio qkv / peer.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

TEXTS = [
    "The cat sat because it was tired.",
    "A man is playing a guitar on the street while people walk by.",
    "",
    "Attention is all you need.",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up. " * 3,
    "Short.",
    "Sentence embeddings map texts of any length to one vector each.",
    "ünïcödé and an emoji 🙂",
]


def _interleave(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(2)

    import transformers
    from sentence_transformers import SentenceTransformer

    import qkv.models

    path = str(qkv.models.default_model_path())
    ours = qkv.models.load(path)
    st = SentenceTransformer(path, device="cpu")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    bert = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    text = TEXTS[0]

    def hf_maps() -> object:
        with torch.inference_mode():
            return bert(**tok(text, return_tensors="pt"), output_attentions=True).attentions

    same = [f"Sentence number {i} has exactly the same shape as the others." for i in range(32)]
    rows = [
        (
            f"encode, batch of {len(TEXTS)} mixed lengths",
            _interleave(
                {
                    "qkv": lambda: ours.encode(TEXTS),
                    "peer": lambda: st.encode(TEXTS, convert_to_tensor=True),
                },
                args.reps,
            ),
            "sentence-transformers",
        ),
        (
            "encode, batch of 32 equal lengths (nothing to pack)",
            _interleave(
                {
                    "qkv": lambda: ours.encode(same),
                    "peer": lambda: st.encode(same, convert_to_tensor=True),
                },
                args.reps,
            ),
            "sentence-transformers",
        ),
        (
            "attention_maps, 10 tokens",
            _interleave({"qkv": lambda: ours.attention_maps(text), "peer": hf_maps}, args.reps),
            "transformers eager",
        ),
    ]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, reps {args.reps}")
    print("| case | peer | qkv median (ms) | peer median (ms) | qkv / peer |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, med, peer in rows:
        q, p = med["qkv"] * 1e3, med["peer"] * 1e3
        print(f"| {name} | {peer} | {q:.2f} | {p:.2f} | {q / p:.2f} |")


if __name__ == "__main__":
    main()

"""One decode step with GQA (9 query heads on 3 kv heads, as SmolLM2): SDPA with
``enable_gqa=True`` against the same call with each kv head's query heads folded into query
rows (what qkv's sdpa backend does for one query row, no mask), and ``qkv.attention``.
Interleaved, best of 5 x 200 calls, one thread.

    python benchmarks/gqa_decode.py
"""

from __future__ import annotations

import timeit
from collections.abc import Callable

import torch
import torch.nn.functional as F

import qkv


def _calls(Lk: int) -> dict[str, Callable[[], object]]:
    q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, Lk, 64), torch.randn(1, 3, Lk, 64)
    return {
        "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "folded": lambda: F.scaled_dot_product_attention(q.view(1, 3, 3, 64), k, v),
        "qkv.attention": lambda: qkv.attention(q, k, v),
    }


def main() -> None:
    torch.set_num_threads(1)
    for Lk in (100, 1000, 4000):
        calls = _calls(Lk)
        best = {n: float("inf") for n in calls}
        for _ in range(5):
            for n, f in calls.items():
                best[n] = min(best[n], timeit.timeit(f, number=200) / 200)
        print(f"Lk={Lk}: " + ", ".join(f"{n} {t * 1e6:.1f} us" for n, t in best.items()))


if __name__ == "__main__":
    main()

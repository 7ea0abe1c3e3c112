"""``qkv walkthrough``: attention built up step by step on a tiny example, every number
computed by qkv and checked against the plain formula as it goes."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=4, help="sequence length (default 4)")
    p.add_argument("--dim", type=int, default=8, help="model width d_model (default 8)")
    p.add_argument("--heads", type=int, default=2, help="heads for the multi-head step")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def _grid(t: object, rows: list[str], cols: list[str]) -> str:
    import torch

    assert isinstance(t, torch.Tensor)
    width = max(6, *(len(c) for c in cols))
    lines = [" " * 8 + "".join(f"{c:>{width}}" for c in cols)]
    for name, row in zip(rows, t.tolist(), strict=True):
        lines.append(f"{name:>8}" + "".join(f"{x:>{width}.2f}" for x in row))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    import qkv

    n, d, h = args.tokens, args.dim, args.heads
    if n < 1 or d < 1 or h < 1 or d % h:
        raise ValueError(
            f"need tokens >= 1, dim >= 1 and dim divisible by heads; got tokens={n}, dim={d}, "
            f"heads={h}"
        )
    torch.manual_seed(args.seed)
    words = ["The", "cat", "sat", "on", "the", "mat", "and", "slept"]
    names = [words[i] if i < len(words) else f"t{i}" for i in range(n)]
    x = torch.randn(n, d)  # [n, d_model] token embeddings
    w_q, w_k, w_v = (torch.randn(d, d) / d**0.5 for _ in range(3))
    q, k, v = x @ w_q, x @ w_k, x @ w_v  # [n, d] each

    print(f"1. Project {n} tokens of width {d} three ways: Q = X W_Q, K = X W_K, V = X W_V")
    print(f"   X {list(x.shape)} -> Q {list(q.shape)}, K {list(k.shape)}, V {list(v.shape)}")
    out, weights = qkv.reference.attention(q, k, v)
    print("\n2. Scores Q Kᵀ / √d, softmax per row: the attention weights A (rows = queries)")
    print(_grid(weights, names, names))
    sums = weights.sum(-1)
    print(f"   every row sums to 1: {[round(s, 4) for s in sums.tolist()]}")
    fast = qkv.attention(q, k, v)
    assert isinstance(fast, torch.Tensor)
    print(f"\n3. Output A V: {list(out.shape)}, one blended value per token")
    print(
        f"   qkv.attention (backend {qkv.plan(q, k, v).backend!r}) matches the formula: "
        f"max |diff| = {(fast - out).abs().max().item():.1e}"
    )

    _, causal_w = qkv.reference.attention(q, k, v, mask=qkv.causal)
    print("\n4. Causal self-attention (mask=qkv.causal): nothing above the diagonal")
    print(_grid(causal_w, names, names))
    above = torch.triu(causal_w, diagonal=1)
    print(f"   largest weight above the diagonal: {above.abs().max().item():.1f}")

    n_enc = n + 1
    enc = torch.randn(n_enc, d)  # [n_enc, d_model] an encoder's output
    _, cross_w = qkv.reference.attention(x[: n - 1] @ w_q, enc @ w_k, enc @ w_v)
    print(
        f"\n5. Cross-attention: {n - 1} decoder queries against {n_enc} encoder keys; the "
        f"score matrix is {list(cross_w.shape)}, not square"
    )
    print(_grid(cross_w, names[: n - 1], [f"e{j}" for j in range(n_enc)]))

    dh = d // h
    qh = q.view(n, h, dh).transpose(0, 1)  # [h, n, d/h]
    kh = k.view(n, h, dh).transpose(0, 1)  # [h, n, d/h]
    vh = v.view(n, h, dh).transpose(0, 1)  # [h, n, d/h]
    heads = qkv.attention(qh, kh, vh, mask=qkv.causal)
    assert isinstance(heads, torch.Tensor)
    print(
        f"\n6. Multi-head: {h} heads of width {dh} are one extra tensor dim: "
        f"{list(qh.shape)} -> {list(heads.shape)} -> concat {[n, d]}"
    )
    return 0

"""The cases ``qkv bench`` times: its masks (as qkv mask_mods, FlexAttention mask_mods and
the dense bool tensors SDPA gets) and the peer callables, forward or forward+backward."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MASKS = ("none", "causal", "window", "document", "prefix")


@dataclass
class MaskSpec:
    """A benchmark mask: the qkv mask_mod, its visible pair count and a dense builder."""

    name: str
    mod: Any  # qkv mask_mod or None
    pairs: float  # visible (query, key) pairs per (batch, head)
    flex: Callable[..., Any] | None  # FlexAttention mask_mod (None = no mask)


def doc_ids(n: int, docs: int) -> Any:
    """Seeded random document lengths (at least 1 each) covering ``n`` positions."""
    import torch

    gen = torch.Generator().manual_seed(0)
    docs = max(1, min(docs, n))
    cuts = torch.randperm(n - 1, generator=gen)[: docs - 1] + 1 if docs > 1 else torch.tensor([])
    bounds = [0, *sorted(int(c) for c in cuts), n]
    ids = torch.zeros(n, dtype=torch.int64)
    for d in range(docs):
        ids[bounds[d] : bounds[d + 1]] = d
    return ids


def make_mask(name: str, n: int, args: argparse.Namespace) -> MaskSpec:
    import torch

    import qkv

    i = torch.arange(n, dtype=torch.float64)
    if name == "none":
        return MaskSpec(name, None, float(n) * n, None)
    if name == "causal":
        return MaskSpec(name, qkv.causal, n * (n + 1) / 2, lambda b, h, q, k: q >= k)
    if name == "window":
        w = args.window
        pairs = float(torch.clamp(i + 1, max=w).sum())

        def flex_window(b: Any, h: Any, q: Any, k: Any) -> Any:
            return (q >= k) & (q - k < w)

        return MaskSpec(f"window{w}", qkv.sliding_window(w - 1), pairs, flex_window)
    if name == "document":
        ids = doc_ids(n, args.docs)
        lens = torch.bincount(ids).double()
        pairs = float((lens * (lens + 1) / 2).sum())

        def flex_doc(b: Any, h: Any, q: Any, k: Any) -> Any:
            return (q >= k) & (ids[q] == ids[k])

        mod = qkv.and_masks(qkv.causal, qkv.document(ids))
        return MaskSpec(f"doc{args.docs}-causal", mod, pairs, flex_doc)
    if name == "prefix":
        pre = min(args.prefix, n)
        pairs = float(torch.clamp(i + 1, min=pre).sum())

        def flex_prefix(b: Any, h: Any, q: Any, k: Any) -> Any:
            return (k < pre) | (q >= k)

        return MaskSpec(f"prefix{pre}", qkv.prefix_lm(pre), pairs, flex_prefix)
    raise ValueError(f"unknown mask {name!r}; use {', '.join(MASKS)}")


def dense_bool(spec: MaskSpec, n: int) -> Any:
    """The mask as the ``[n, n]`` bool tensor SDPA needs."""
    import torch

    from .._core.evaluate import grid

    b, h, q, k = grid((0, 1), (0, 1), (0, n), (0, n), torch.device("cpu"))
    return spec.mod(b, h, q, k)[0, 0]


# ------------------------------------------------------------------------------- peers


def make_peers(
    spec: MaskSpec, n: int, args: argparse.Namespace, peers: list[str], notes: list[str]
) -> dict[str, Callable[..., Any]]:
    """Callables ``f(q, k, v) -> out`` for each peer that can run this case."""
    import torch.nn.functional as F

    import qkv

    out: dict[str, Callable[..., Any]] = {}
    if "qkv" in peers:
        mod = spec.mod
        out["qkv"] = lambda q, k, v: qkv.attention(q, k, v, mask=mod)
    if "sdpa" in peers:
        if spec.mod is None:
            out["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
        elif spec.name == "causal":
            out["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            itemsize = 4 if args.dtype == "float32" else 2
            need = n * n * (1 + itemsize) / 2**30
            if need > args.max_dense_gib:
                notes.append(f"sdpa skipped at n={n} {spec.name}: dense mask {need:.1f} GiB")
            else:
                dense = dense_bool(spec, n)
                out["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=dense
                )
    if "flex" in peers:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            compiled = _compiled_flex(flex_attention)
            bm = (
                create_block_mask(spec.flex, None, None, n, n, device="cpu")
                if spec.flex is not None
                else None
            )
            out["flex"] = lambda q, k, v: compiled(q, k, v, block_mask=bm)
        except Exception as e:  # pragma: no cover - depends on the machine's toolchain
            notes.append(f"flex unavailable: {type(e).__name__}: {e}"[:200])
    return out


_FLEX: dict[str, Any] = {}


def _compiled_flex(fn: Any) -> Any:
    import torch

    if "f" not in _FLEX:
        _FLEX["f"] = torch.compile(fn)
    return _FLEX["f"]


# ------------------------------------------------------------------------------ timing

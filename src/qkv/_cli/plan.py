"""``qkv plan``: print :func:`qkv.plan` for a problem described on the command line."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..typing import MaskLike

_MASKS = "none, causal, window:LEFT[:RIGHT], prefix:N"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", "-b", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads)")
    p.add_argument("--q-len", type=int, default=4096)
    p.add_argument("--kv-len", type=int, default=None, help="default: q-len")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--mask", default="none", help=f"one of {_MASKS}")
    p.add_argument("--backend", default="auto")


def _mask(spec: str) -> MaskLike:
    import qkv

    kind, _, rest = spec.partition(":")
    try:
        if kind == "none":
            return None
        if kind == "causal":
            return qkv.causal
        if kind == "window":
            return qkv.sliding_window(*(int(x) for x in rest.split(":")))
        if kind == "prefix":
            return qkv.prefix_lm(int(rest))
    except ValueError as e:
        raise ValueError(f"bad --mask {spec!r}: {e}") from None
    raise ValueError(f"unknown --mask {spec!r}; use one of {_MASKS}")


def run(args: argparse.Namespace) -> int:
    import torch

    import qkv

    hkv = args.kv_heads or args.heads
    lk = args.kv_len or args.q_len
    dtype = getattr(torch, args.dtype)
    # Meta tensors: the plan needs shapes, not data, so even huge problems cost nothing.
    q = torch.empty(args.batch, args.heads, args.q_len, args.head_dim, dtype=dtype, device="meta")
    k = torch.empty(args.batch, hkv, lk, args.head_dim, dtype=dtype, device="meta")
    print(qkv.plan(q, k, k, mask=_mask(args.mask), backend=args.backend))
    return 0

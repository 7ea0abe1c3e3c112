"""The decode backend: a few query rows against many keys, the keys split across threads.

A decode step attends one new token per head to the whole KV cache. torch's fused CPU kernel
parallelises over (batch, head, query block), which leaves threads idle when there are fewer
heads than threads can share evenly (SmolLM2's 3 kv heads on 2 threads) and pays for blocking
meant for long query runs. ``kernels/decode.cpp`` instead makes its work items
(batch, kv head, key split): each runs an online softmax over its share of the keys for all
``G * Lq`` query rows of that kv head (grouped-query heads read each key once), and the
splits are merged by their maxima and sums (FlashDecoding's split-key scheme, Dao et al.
2023). Measured in benchmarks/RESULTS.md: ~2x torch's SDPA on a SmolLM2 decode
step from 100 to 16k cached keys on 2 threads.

It computes float32 CPU problems with at most ``MAX_ROWS`` query rows per kv head, no score
mod, no dropout and no gradient (it has no backward), under no mask, ``qkv.causal``, bands
(sliding windows), per-batch key ranges (``qkv.padding``) and their intersections: each row
sees one contiguous run of keys. Everything else goes to the other backends. Like the band
kernel it is built on first use (:class:`qkv.native.NativeLibrary`) and is never a
requirement: without a compiler the planner passes over it and says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..._core.kinds import MaskKind
from ..._core.problem import Problem
from ...native import NativeLibrary
from ..base import Backend, Kernel, Route, Runner, Unavailable

Tensor = torch.Tensor

__all__ = ["MAX_ROWS", "DecodeBackend", "key_ranges", "one_run_per_row"]

# Query rows per kv head (G * Lq) the kernel takes. Measured against SDPA (2 threads, D=64,
# 64-4096 keys): 0.3-0.8x its time up to 16 rows; at 32 rows it was 0.9-1.2x (the kernel
# scores a row at a time; SDPA's GEMMs win once there are many rows).
MAX_ROWS = 16


def _fake(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    return out, q.new_empty(q.shape[:3])


LIBRARY = NativeLibrary(
    "qkv_decode",
    [Path(__file__).parent / "kernels" / "decode.cpp"],
    what="CPU decode kernel",
    fakes={"decode_forward": _fake},
)


def one_run_per_row(m: MaskKind) -> bool:
    """True when every row of ``m`` sees one contiguous run of keys (what the kernel takes):
    its terms are at most a band and a key range per batch element; nothing is built."""
    return m.terms.only(band=True, keys=True)


def key_ranges(
    m: MaskKind, B: int, Lq: int, Lk: int
) -> tuple[int, int, Tensor | None, Tensor | None] | None:
    """The mask as ``(lo, hi, start, end)``: row ``i`` of batch ``b`` sees the keys ``j`` with
    ``lo <= j - i <= hi`` and ``start[b] <= j < end[b]`` (``start``/``end`` int64 ``[B]`` or
    ``None`` for all keys); ``None`` when the mask is not of that form
    (:func:`one_run_per_row`)."""
    if not one_run_per_row(m):
        return None
    far = Lq + Lk  # "unbounded": beyond every key of every row, and no overflow in C++
    lo, hi = -far, far
    if m.terms.band is not None:
        b_lo, b_hi = m.terms.band
        lo = -far if b_lo is None else max(b_lo, -far)
        hi = far if b_hi is None else min(b_hi, far)
    keys = m.terms.keys
    if keys is None:
        return lo, hi, None, None
    start, end = (t.to("cpu").contiguous() for t in keys.per_batch(B))
    return lo, hi, start, end


class DecodeBackend(Backend):
    """qkv's compiled split-key decode kernel (CPU, float32, no backward)."""

    name = "decode"
    materialises_scores = False  # O(rows x Dv x splits) scratch, never Lq x Lk

    def rejects(self, p: Problem) -> str | None:
        if torch.compiler.is_compiling():
            return "torch.compile traces torch's own kernels; the decode kernel runs eagerly"
        if p.device.type not in ("cpu", "meta"):
            return f"it is a CPU kernel (tensors are on {p.device.type})"
        if p.dtype != torch.float32:
            return f"it computes float32 only (inputs are {str(p.dtype).replace('torch.', '')})"
        rows = p.groups * p.Lq
        if rows > MAX_ROWS:
            return (
                f"it takes at most {MAX_ROWS} query rows per kv head (a decode step); this "
                f"problem has {p.groups} query heads per kv head x Lq={p.Lq} = {rows}"
            )
        if not p.score.is_none:
            return "it applies no score_mod or bias"
        if p.dropout_p > 0:
            return "it applies no dropout"
        if p.requires_grad():
            return "it has no backward (a call that needs gradients goes elsewhere)"
        if not one_run_per_row(p.mask):
            return f"the mask ({p.mask.name}) does not give each row one contiguous run of keys"
        return LIBRARY.disabled()

    def claims(self, p: Problem) -> str | None:
        # Measured (benchmarks/RESULTS.md): 0.3-0.8x SDPA's time for up to 16 query
        # rows per kv head on 2 threads, ~0.5x on a SmolLM2 decode step at 100-16k keys.
        return (
            "qkv's decode kernel computes this faster (a few query rows per kv head against "
            "their keys, the keys split across threads)"
        )

    def route(self, p: Problem, *, dry_run: bool = False) -> Route:
        if not dry_run and p.device.type == "cpu" and LIBRARY.ops() is None:
            raise Unavailable(
                LIBRARY.disabled() or "the compiled decode kernel could not be loaded"
            )
        threads = torch.get_num_threads()
        splits = 4 * threads  # at most; the kernel picks fewer for small calls
        scratch = p.B * p.Hkv * min(splits, max(1, p.Lk)) * p.groups * p.Lq * (p.Dv + 2) * 4
        return Route(
            forward=(
                f"qkv's compiled decode kernel: each kv head's {p.groups} query heads x "
                f"{p.Lq} rows against its keys, the keys split across {threads} threads"
            ),
            backward="none (the decode kernel runs only when no gradient is needed)",
            extra_memory=scratch,
        )

    def run(self, p: Problem, route: Route) -> tuple[Tensor, Tensor | None]:
        out, lse = forward(p)
        return out, (lse if p.return_lse else None)

    def runner(self, p: Problem, route: Route) -> Runner | None:
        # per-batch key ranges (padding) are read from the mask's tensors once, here: a kept
        # runner is keyed on their versions (qkv._planning.signature)
        return _bound(p) if one_run_per_row(p.mask) else None


def forward(p: Problem, splits: int = 0) -> tuple[Tensor, Tensor]:
    """``out [B, Hq, Lq, Dv]`` and ``lse [B, Hq, Lq]`` (float32; 0 and ``-inf`` on rows that
    see no key). ``splits`` > 0 forces the number of key splits per (batch, kv head), for tests;
    0 lets the kernel choose."""
    if p.device.type == "meta":
        return _fake(p.q, p.k, p.v)
    out, lse = _bound(p, splits)(p.q, p.k, p.v)
    assert lse is not None
    return out, lse


def _bound(p: Problem, splits: int = 0) -> Kernel:
    """The kernel with everything of ``p`` but its tensors bound: ``(q, k, v) -> (out, lse)``
    for any call of ``p``'s shapes and mask (a decoder's repeat calls run this alone)."""
    ranges = key_ranges(p.mask, p.B, p.Lq, p.Lk)
    assert ranges is not None, "the planner sends only masks of one key run per row here"
    lo, hi, s, e = ranges
    start, end = (_EMPTY, _EMPTY) if s is None or e is None else (s, e)
    ops = LIBRARY.ops()
    assert ops is not None, "route() checked that the kernel is loaded"
    op, scale = ops.decode_forward.default, p.scale

    def run(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None]:
        res: tuple[Tensor, Tensor] = op(q, k, v, start, end, lo, hi, scale, splits)
        return res

    return run


_EMPTY = torch.empty(0, dtype=torch.int64)

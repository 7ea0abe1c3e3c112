"""qkv's compiled CPU band kernel: ``kernels/band.cpp``, built on first use (``qkv.native``).

Two operators from one source: ``band_forward`` and ``band_backward``, the forward and
backward of band masks (sliding windows) on float32 CPU tensors, optionally with a key range
per batch element or document ids (:func:`extras`: small padding and document masks). They
are an accelerator, never a requirement: when they cannot be built (no C++ compiler,
``QKV_NATIVE=0``, a failed build) the block-sparse engine runs the same problem with torch's
fused kernel, and :func:`qkv.plan` says which one runs. Building, caching and loading are
:class:`qkv.native.NativeLibrary`'s (per torch version and CPU capability, under
``$QKV_NATIVE_DIR`` or ``~/.cache/qkv/native``); ``qkv build`` builds it ahead of time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..._core.terms import Terms
from ..._core.tracing import assume_constant_result, is_symbolic
from ...native import NativeLibrary

Tensor = torch.Tensor


def _fake(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    return out, q.new_empty(q.shape[:3])


def _fake_bwd(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


LIBRARY = NativeLibrary(
    "qkv_native",
    # (one source: each translation unit spends ~10 s on ATen's headers, per CPU variant)
    [Path(__file__).parent / "kernels" / "band.cpp"],
    what="CPU band kernel",
    fakes={"band_forward": _fake, "band_backward": _fake_bwd},
)


def cache_dir() -> Path:
    """Where the compiled band kernel lives (per torch version, CPU capability and stamp)."""
    return LIBRARY.cache_dir()


def disabled() -> str | None:
    """Why the compiled kernels will not be used (without building them), or ``None``."""
    return LIBRARY.disabled()


def band_forward_op() -> Any | None:
    """The compiled band-forward operator, building it on first use; ``None`` (with the reason
    logged once, and in :func:`disabled`) when it cannot be had."""
    ops = LIBRARY.ops()
    return None if ops is None else ops.band_forward


# Tuned on a 2-core AVX512 VM (window 256, n=16384; benchmarks/RESULTS.md): 16-row query
# blocks (a block computes 16 + w - 1 keys per row for w useful), up to 32 blocks per task
# (one Kᵀ panel shared by 512 rows: each key transposed ~1.5 times). Within ~5% of each other:
# 32x4 68, 32x8 67, 16x16 65, 16x32 64, 24x12 62 ms (medians of 15 interleaved rounds).
BLOCK = 16
MAX_CHUNK = 32
SYMBOLIC_CHUNK = 8


def _chunk(blocks: int, per_thread: int) -> int:
    """Query blocks per task: enough tasks for every thread (``per_thread`` each), then as
    many blocks per task as allowed (the fewer tasks, the fewer Kᵀ panels). With a symbolic
    length (torch.compile, dynamic shapes) a fixed chunk: the operator takes an int, which a
    symbolic one would be specialised to, compiling the graph again for every other count
    of blocks (the chunk sets how work is split, not what is computed; chunks of 4-32 blocks
    were within ~5% of each other in the tuning above)."""
    if is_symbolic(blocks):
        return SYMBOLIC_CHUNK
    return _eager_chunk(blocks, per_thread, _threads())


def _eager_chunk(blocks: int, per_thread: int, threads: int) -> int:
    return max(1, min(MAX_CHUNK, blocks // (per_thread * threads)))


@assume_constant_result
def _threads() -> int:
    """torch's thread count; while dynamo traces (which cannot call it), read when the graph
    is traced (it sets how the kernel splits its work, not what it computes)."""
    return torch.get_num_threads()


# The kernel's optional inputs besides the band: (kstart, klimit, ids), int64 CPU tensors
# (kstart and klimit [B], ids [1 or B, L]).
Extras = tuple[Tensor | None, Tensor | None, Tensor | None]
NO_EXTRAS: Extras = (None, None, None)


def extras(terms: Terms, B: int) -> Extras:
    """What the kernel reads of a mask besides its band: the key range per batch element
    (``[B]`` starts and ends; a padding mask) and document ids (``[1, L]``, one row every
    batch element shares, or ``[B, L]``, a row per batch element), as contiguous int64 CPU
    tensors (the mask's own tensors where they already are; copies otherwise)."""
    if terms.keys is None and terms.ids is None:
        return NO_EXTRAS
    start = limit = ids = None
    if terms.keys is not None:
        first, end = terms.keys.per_batch(B)
        limit = _ints(end)
        start = None if terms.keys.start is None else _ints(first)
    if terms.ids is not None:
        ids = _ints(terms.ids)
    return start, limit, ids


def _ints(t: Tensor) -> Tensor:
    return t.to(device="cpu", dtype=torch.int64).contiguous()


def band_forward(
    q: Tensor, k: Tensor, v: Tensor, lo: int, hi: int, scale: float, more: Extras = NO_EXTRAS
) -> tuple[Tensor, Tensor]:
    """``out [B, Hq, Lq, Dv]`` and ``lse [B, Hq, Lq]`` (float32; zeros and ``-inf`` on rows
    that see no key) for the band ``lo <= k - q <= hi`` and what ``more`` (:func:`extras`)
    adds. The planner calls this only after :func:`band_forward_op` returned the operator."""
    op = band_forward_op()
    if op is None:
        raise RuntimeError(f"qkv's compiled band kernel is unavailable: {disabled()}")
    chunk = _chunk(q.shape[0] * q.shape[1] * -(-q.shape[2] // BLOCK), per_thread=4)
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    out, lse = op(qc, kc, vc, lo, hi, scale, BLOCK, chunk, *more)
    return out, lse


def band_runner(
    lo: int, hi: int, scale: float, more: Extras = NO_EXTRAS
) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None:
    """:func:`band_forward` with the operator and everything but q, k, v bound, for the eager
    repeat calls of a kept plan (``None`` when the kernel cannot be had). A repeat call then
    runs this file and the kernel only: the operator is looked up once, here (the kept plan's
    signature holds ``QKV_NATIVE``, so a switch plans anew, and the mask's tensors by
    identity and version, so a copy of ``more`` made now holds the call's values)."""
    op = band_forward_op()
    if op is None:
        return None
    # Copies: the kept plan must not keep the mask's tensors alive (its signature holds them
    # weakly, and forgets the plan when they go); an in-place edit is a new signature anyway.
    start, limit, ids = (None if t is None else t.clone() for t in more)

    def run(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        blocks = q.shape[0] * q.shape[1] * -(-q.shape[2] // BLOCK)
        chunk = _eager_chunk(blocks, 4, torch.get_num_threads())
        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = op(qc, kc, vc, lo, hi, scale, BLOCK, chunk, start, limit, ids)
        return out, lse

    return run


def band_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    dout: Tensor,
    lse_hi: Tensor,
    lse_lo: Tensor,
    dlse: Tensor | None,
    lo: int,
    hi: int,
    scale: float,
    more: Extras = NO_EXTRAS,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` (float32) of :func:`band_forward`'s band (and ``more``), recomputed
    from its ``out`` and lse (as float32 ``hi + lo`` parts of the float64 lse, rows without
    keys finite: ``grads.lse_hi_lo``) and the upstream ``dout`` and ``dlse`` (``None`` when
    nothing flowed into the lse)."""
    ops = LIBRARY.ops()
    if ops is None:
        raise RuntimeError(f"qkv's compiled band kernel is unavailable: {disabled()}")
    d = q.new_empty(0) if dlse is None else dlse.float().contiguous()
    chunk = _chunk(q.shape[0] * k.shape[1] * -(-q.shape[2] // BLOCK), per_thread=8)
    grads: tuple[Tensor, Tensor, Tensor] = ops.band_backward(
        *(t.contiguous() for t in (q, k, v, out, dout)),
        lse_hi.contiguous(),
        lse_lo.contiguous(),
        d,
        lo,
        hi,
        scale,
        BLOCK,
        chunk,
        *more,
    )
    return grads

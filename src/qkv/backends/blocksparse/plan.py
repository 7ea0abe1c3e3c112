"""Planning one block-sparse call: the one place that decides how it is computed.

:func:`make_job` reads the classified problem and picks a route (``job.JobRoute``):

1. **segments** — the problem is one or a few mask-free fused calls: no mask or causal (the
   fused kernel's ``is_causal`` is top-left aligned, as :data:`qkv.causal`), prefix-LM
   (prefix, then the rest causally, merged by lse), sorted documents (optionally causal);
2. **native_band** — a sliding window in float32 on the CPU: qkv's compiled band kernel,
   forward and backward; also small padding and document masks (the kernel takes each batch
   element's key range and document ids beside the band);
3. **band_groups** — a band on torch's fused kernel: query blocks batched along the band
   forward, key blocks backward;
4. **pieces** — anything else: per query block its visible key blocks, with torch's fused
   kernel, or explicit matmuls where a score_mod, dropout or a bias gradient needs them.

:func:`describe` turns the job into the forward and backward kernel texts ``qkv.plan``
prints, from the same job that runs.
"""

from __future__ import annotations

import functools

import torch

from ..._core.kindspec import unwatched
from ..._core.problem import Problem
from ..._core.tiles import DEFAULT_BLOCK
from ...blockmask import BlockMask, build
from ..base import small_grid
from . import schedule
from .cost import weigh
from .job import Job, Segment, fused_ok

Tensor = torch.Tensor

# Widest band (hi - lo) the compiled kernel takes: its per-thread buffers grow with it
# (32 x 8 K scores, a D x 8 K panel); wider bands are block-sparse enough for the pieces.
NATIVE_MAX_WIDTH = 8192


def make_job(p: Problem, *, matmul: bool = False, dry_run: bool = False) -> Job:
    """Plan one call (``matmul=True`` forces explicit matmuls). ``dry_run`` (for
    :func:`qkv.plan`) decides without building the compiled kernel."""
    fused = fused_ok(p) is None and not matmul
    plain = fused and p.score.bias is None  # torch's fused kernel with no additive mask
    jobs = []
    if plain and p.Lk > 0 and (segments := _segments(p)):
        jobs.append(Job(call=p, route="segments", fused=True, segments=tuple(segments)))
    if plain and native_band(p, build=not dry_run) is None:
        # The compiled band kernel computes the forward and the backward (backward.py).
        edges = band_edges(p)
        jobs.append(Job(call=p, route="native_band", fused=True, native_band=edges, masked=True))
    if len(jobs) > 1:  # (sorted documents, a prefix: mask-free calls or the band kernel)
        return min(jobs, key=lambda job: weigh(p, job).blocksparse)
    return jobs[0] if jobs else _torch_job(p, fused)


def band_edges(p: Problem) -> tuple[int, int]:
    """``(lo, hi)`` of the band the compiled kernel computes: the mask's own (a window), or
    for a padding or document mask its band (if any) cut to the keys that exist, so that an
    edge left open covers every key."""
    lo, hi = p.mask.lo, p.mask.hi
    if p.mask.terms.keys is None and p.mask.terms.ids is None:
        assert lo is not None and hi is not None
        return lo, hi
    lo = -(p.Lq - 1) if lo is None else max(lo, -(p.Lq - 1))
    hi = p.Lk - 1 if hi is None else min(hi, p.Lk - 1)
    return lo, hi


def native_band(p: Problem, *, build: bool = True) -> str | None:
    """Why the compiled band kernel (``kernels/band.cpp``) cannot compute this problem, or
    ``None`` if it will. ``build=False`` answers without building it (for :func:`qkv.plan`,
    which must not wait ~15 s on a compiler)."""
    from . import native

    why = native_band_shape(p)
    if why is not None:
        return why
    ids = p.mask.terms.ids
    if ids is not None and not small_grid(p) and not sorted_rows(ids):
        return (
            "a batch row's document ids are not sorted (past 2^20 scores the kernel would "
            "compare them score by score; the tile plans skip what no row's documents meet)"
        )
    if not build or p.device.type == "meta":
        return native.disabled()
    if native.band_forward_op() is None:
        return native.disabled() or "the compiled kernel could not be loaded"
    return None


def native_band_shape(p: Problem) -> str | None:
    """Why the compiled band kernel cannot compute this problem whatever is built, or
    ``None``: read from the problem alone (no file, no tensor value: torch.compile's trace
    asks it)."""
    why_not_fused = fused_ok(p)
    if why_not_fused is not None:
        return why_not_fused
    m, t = p.mask, p.mask.terms
    if p.score.bias is not None:
        return "a bias is added"
    if t.keys is not None or t.ids is not None:
        if not t.only(band=True, keys=True, ids=True):
            return "the mask is more than a band, a key range per batch element and documents"
        if m.block is not None:
            return "the mask came as a block mask: its tile plan runs"
        # (Where it is slower than the alternatives, with gradients on a small problem, say,
        # the costs decide: make_job weighs it against mask-free calls, and auto against
        # SDPA on the dense mask; blocksparse/cost.py.)
    elif not m.is_band or m.lo is None or m.hi is None:
        return "the mask is not a band with both edges (a sliding window)"
    if p.dtype != torch.float32:
        return f"it computes float32 only (inputs are {str(p.dtype).replace('torch.', '')})"
    if p.device.type not in ("cpu", "meta"):
        return f"it is a CPU kernel (tensors are on {p.device.type})"
    if p.Lq == 0 or p.Lk == 0:
        return "there are no queries or no keys"
    lo, hi = band_edges(p)
    if hi < lo:
        return "the band is empty (every key is masked)"
    if hi - lo > NATIVE_MAX_WIDTH:
        return f"the band is wider than {NATIVE_MAX_WIDTH} keys"
    return None


def sorted_rows(ids: Tensor) -> bool:
    """Whether every row of document ids ``[R, L]`` is sorted: each document one run of
    positions, so the band kernel narrows every block to its documents' keys. Ids on the meta
    device have no values to read: planned as the sorted packing they usually are. Measured
    for ids per batch row (B=8, H=4, D=64 float32, 3-6 documents per row with causal, forward
    and backward, 2 threads, medians of interleaved runs): the kernel 0.31x SDPA's time on
    the dense mask at L=256 and 0.15-0.24x at L=1024; the engine's tile plans 1.08x and
    1.05x (the same rows as a user's mask_mod, evaluated tile by tile: 4.3x and 2.1x)."""
    if ids.device.type == "meta":
        return True
    ids = ids.detach().to("cpu")
    return ids.shape[1] < 2 or bool((ids[:, 1:] >= ids[:, :-1]).all())


def block_mask_of(p: Problem, block_size: tuple[int, int] | None = None) -> BlockMask:
    """The problem's block mask: the one passed in, else one built for this call."""
    if p.mask.block is not None:
        bm: BlockMask = p.mask.block
        return bm
    size = block_size or (DEFAULT_BLOCK, DEFAULT_BLOCK)
    return build(p.mask, (p.B, p.Hq, p.Lq, p.Lk), (False, False), size, p.device)


def _torch_job(p: Problem, fused: bool) -> Job:
    """The plan with torch's kernels (fused CPU flash per piece or band group, or explicit
    matmuls)."""
    m, bias = p.mask, p.score.bias
    plain = fused and bias is None
    if plain and m.is_band and p.Hq == p.Hkv and m.block is None:
        # Band masks depend on (lo, hi, lengths) only: their plans are cached by value, so a
        # model calling sliding_window(w) in every layer plans once. Measured
        # (benchmarks/RESULTS.md): the fused forward kernel runs a 256-wide window fastest
        # with 32-row blocks (less of each tile is masked off) while its backward prefers
        # 128; both are exact with the global out and lse, so each takes its own blocks.
        # The finer forward grid has 16x the tiles; past ~16 M of them (n ~ 128 K) the
        # int8 tile grid itself would cost more than it saves, so both use the default.
        fine = -(-p.Lq // schedule.FWD_BAND_BLOCK) * -(-p.Lk // schedule.FWD_BAND_BLOCK)
        b_fwd = schedule.FWD_BAND_BLOCK if fine <= 1 << 24 else DEFAULT_BLOCK
        return Job(
            call=p,
            route="band_groups",
            fused=True,
            fwd=schedule.band_schedule(m.lo, m.hi, p, b_fwd),
            bwd_build=functools.partial(
                schedule.band_bwd_schedule,
                m.lo,
                m.hi,
                p.Lq,
                p.Lk,
                schedule.row_elems(p),
                schedule.BWD_BAND_BLOCK,
            ),
            masked=True,
        )
    bm = block_mask_of(p)
    bq, bk = bm.block_size
    md = (bm.states.shape[0], bm.states.shape[1])
    per_key = bq * (md[0] * md[1] if plain else p.B * p.Hq)
    max_span = max(1, schedule.PIECE_BUDGET // max(1, per_key))
    grouped = plain and m.is_band and md == (1, 1) and p.Hq == p.Hkv and bq == bk
    elems = schedule.row_elems(p)
    return Job(
        call=p,
        route="band_groups" if grouped else "pieces",
        fused=fused,
        fwd=schedule.schedule(bm, max_span, bq if grouped else 0, elems),
        bwd_build=(
            functools.partial(schedule.key_schedule, bm, max_span, bq, elems) if grouped else None
        ),
        masked=not m.is_none,
        mask_dims=md,
        block=bm,
        replan=unwatched(m),
    )


def _segments(p: Problem) -> list[Segment]:
    """Mask-free fused calls that compute the problem exactly, if there are any: the whole
    problem for no mask or causal; for ``prefix_lm(P)`` the prefix rows against the prefix,
    then the later rows against the prefix and, causally, against the rest (two calls over
    the same rows, merged by their lse); one call per document for sorted document ids
    (optionally with causal): documents are independent attention problems. Segments over
    the same rows are adjacent in the list.

    None when a call would be causal and ``scale <= 0``: torch's fused kernel gives NaN for
    ``is_causal`` with a zero or negative scale (torch 2.13, tests/test_contract_edges.py),
    so such problems go to tiles, whose masks are explicit."""
    segs = _mask_free_calls(p)
    if p.scale <= 0 and any(causal for *_, causal in segs):
        return []
    return segs


def _mask_free_calls(p: Problem) -> list[Segment]:
    m = p.mask
    if m.is_none or m.is_causal:
        return [(0, p.Lq, 0, p.Lk, m.is_causal)]
    prefix = m.terms.prefix
    if prefix is not None and m.terms.only(prefix=True):
        P = min(prefix, p.Lk)
        if P == 0:
            return [(0, p.Lq, 0, p.Lk, True)]
        segs: list[Segment] = [(0, min(P, p.Lq), 0, P, False)]
        if p.Lq > P:
            segs.append((P, p.Lq, 0, P, False))
            if p.Lk > P:  # rows r >= P see keys P..r: causal, top-left aligned at P
                segs.append((P, p.Lq, P, p.Lk, True))
        return segs
    doc = m.document_causal()
    if p.Lq != p.Lk or doc is None or doc[0].shape[0] != 1:
        return []  # (ids per batch row: no call spans the batch; the kernel or tiles run)
    ids, causal = doc[0][0].detach().to("cpu")[: p.Lq], doc[1]
    if ids.numel() > 1 and not bool((ids[1:] >= ids[:-1]).all()):
        return []
    starts = [0, *(torch.nonzero(ids[1:] != ids[:-1]).view(-1) + 1).tolist()]
    if len(starts) > max(8, p.Lq // 128):  # many tiny documents: tiles do better
        return []
    ends = [*starts[1:], p.Lq]
    return [(a, b, a, b, causal) for a, b in zip(starts, ends, strict=True)]


def describe(job: Job) -> tuple[str, str]:
    """The forward and backward kernels of a job, for a person."""
    p = job.p
    if not job.fused:
        why = fused_ok(p) or "asked for explicit matmuls"
        fwd = f"explicit matmuls per block ({why})"
        bwd = "explicit matmuls per block, recomputed from the saved lse"
        if job.score_mod is not None:
            bwd += "; the score_mod re-run under autograd on each block"
        return fwd, bwd
    if job.route == "segments":
        n = len(job.segments)
        if n == 1 and job.segments[0][:2] == (0, p.Lq):
            fwd = "torch's fused CPU flash kernel on the whole problem (it returns the lse)"
        elif p.mask.terms.prefix is not None:
            fwd = (
                f"torch's fused CPU flash kernel: prefix and causal parts ({n} calls, "
                f"merged by lse)"
            )
        else:
            fwd = f"torch's fused CPU flash kernel once per document ({n} calls)"
        return fwd, "torch's fused CPU flash backward on the same calls"
    if job.route == "native_band":
        t = p.mask.terms
        more = [
            w
            for w, x in (("each batch element's key range", t.keys), ("document ids", t.ids))
            if x is not None
        ]
        return (
            "qkv's compiled band kernel (C++, built once on first use): each query block "
            "against only the keys its rows see"
            + (f" ({' and '.join(more)} read in the kernel)" if more else ""),
            "qkv's compiled band kernel: recomputes each block from the lse; dq per block, "
            "dk/dv accumulated in place",
        )
    if job.route == "band_groups":
        return (
            "torch's fused CPU flash kernel, query blocks batched along the band (strided "
            "views, visible key blocks only)",
            "torch's fused CPU flash backward, key blocks batched along the band, each "
            "against the queries that see it",
        )
    return (
        "torch's fused CPU flash kernel per query block, visible key blocks only",
        "torch's fused CPU flash backward per query block, recomputed from the saved lse",
    )

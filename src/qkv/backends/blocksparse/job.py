"""The block-sparse engine's work list: what one call computes, piece by piece.

A *piece* is one query block against a run of its visible key blocks; a *band group* is a
run of query blocks with the same band pattern, computed by one fused call; a *segment* is a
mask-free fused call. A :class:`Job` holds everything the forward and backward kernels need
besides q, k, v: the schedule, the mask source, the score_mod or bias, dropout seeds, and
which kernel family runs. ``plan.py`` builds it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from ..._core.evaluate import Axis, mask_at, score_at, size, take
from ..._core.kinds import MaskKind
from ..._core.problem import Problem
from ...blockmask import BlockMask
from ..base import Recipe

Tensor = torch.Tensor


@dataclass
class Piece:
    """One query block ``[q0, q1)`` against the keys ``runs`` (contiguous ``(k0, k1)`` key
    ranges, increasing). ``masked`` lists ``(offset, k0, k1)`` sub-ranges, at ``offset`` within
    the piece's keys, where the mask must be evaluated element-wise."""

    q0: int
    q1: int
    runs: list[tuple[int, int]]
    masked: list[tuple[int, int, int]]
    seed: int
    span: int = 0
    index: Tensor | None = None  # key positions [span] when the runs are not one range

    def __post_init__(self) -> None:
        self.span = sum(k1 - k0 for k0, k1 in self.runs)

    def keys(self, t: Tensor) -> Tensor:
        """``t [B, H, Lk, X]`` restricted to this piece's keys: a view for one run, a gather
        (copy) otherwise."""
        if len(self.runs) == 1:
            k0, k1 = self.runs[0]
            return t[:, :, k0:k1]
        assert self.index is not None
        return t.index_select(2, self.index.to(t.device))

    def key_axis(self) -> Axis:
        """This piece's keys as an axis of a region: its one run, or its positions."""
        if len(self.runs) == 1:
            return self.runs[0]
        assert self.index is not None
        return self.index


class HiddenDependency(Exception):
    """A score_mod's output depends on a learnable tensor that inspection did not find."""


@dataclass
class BandGroup:
    """Query blocks ``i0 .. i0+n-1`` (all full-size) that see key blocks ``i+c .. i+c+w-1``
    with one and the same mask pattern (a band mask is translation invariant): one fused
    kernel call over strided views covers them all, with one ``[b, w*b]`` additive mask."""

    i0: int
    n: int
    c: int
    w: int
    b: int
    # (device, dtype) -> (additive mask [1, 1, b, w*b] or None, rows without keys [1, 1, b]
    # or None); evaluated once from the group's first row.
    masks: dict[tuple[torch.device, torch.dtype], tuple[Tensor | None, Tensor | None]] = field(
        default_factory=dict
    )


@dataclass
class KeyBandGroup:
    """Key blocks ``j0 .. j0+n-1`` (all full-size), each seen by query blocks
    ``j+c .. j+c+w-1`` (all full-size) with one and the same mask pattern: the backward runs
    them *key-major*, one fused call over strided views in which each key block is one
    problem against its window of ``w*b`` query rows. Each key block's dk and dv then come out
    complete (no overlap); the query windows' dq overlap and are added back ``w`` shifts.

    Measured (benchmarks/RESULTS.md): torch's fused CPU backward runs a 128-key block against
    384 query rows faster than 128 query rows against 384 keys (its inner GEMMs then reduce
    over 64 rows instead of 32), and there is one overlapping gradient to fold instead of two."""

    j0: int
    n: int
    c: int
    w: int
    b: int
    # (device, dtype) -> additive mask [1, 1, w*b, b] or None; evaluated once.
    masks: dict[tuple[torch.device, torch.dtype], Tensor | None] = field(default_factory=dict)


@dataclass
class Schedule:
    """Per query block its pieces (empty where a band group computes it), the groups, and
    (backward schedules only) key-major groups; a piece never covers a key-major group's
    key blocks."""

    rows: list[list[Piece]]
    groups: list[BandGroup]
    key_groups: list[KeyBandGroup] = field(default_factory=list)


# A segment is one mask-free fused call: queries [q0, q1) against keys [k0, k1), causal
# (top-left aligned inside the segment) or not.
Segment = tuple[int, int, int, int, bool]

# How a call is computed, decided once by plan.py:
#   segments    - mask-free fused calls (no mask, causal, prefix-LM, sorted documents)
#   native_band - qkv's compiled band kernel (sliding windows, float32 CPU)
#   band_groups - torch's fused kernel on query blocks batched along a band
#   pieces      - per query block, its visible key blocks (fused, or explicit matmuls)
JobRoute = Literal["segments", "native_band", "band_groups", "pieces"]


class Watch:
    """Set for the first score_mod call of a call that may need gradients: ``check(out, s)``
    says whether the score_mod's output depends on a learnable tensor the engine does not
    know about (see autograd.py). Used once, then cleared."""

    def __init__(self, check: Callable[[Tensor, Tensor], bool]) -> None:
        self.check: Callable[[Tensor, Tensor], bool] | None = check


EMPTY_SCHEDULE = Schedule([], [])
_PER_CALL = frozenset({"call", "seed", "params", "watch"})  # what Job.for_run sets


@dataclass(frozen=True, kw_only=True, eq=False)
class Job(Recipe):
    """Everything the kernels need for one call besides the tensors: the route the plan chose
    (``route``, a :data:`JobRoute`), its schedule, and where the mask and score come from.
    Frozen: the plan decides it once and keeps it unbound (no problem, so none of the call's
    tensors); ``run`` binds each call's problem and per-call values (dropout seed, the tensors
    a score_mod closes over) with :meth:`for_run`."""

    route: JobRoute
    fused: bool  # torch's fused CPU flash kernel per piece (else explicit matmuls)
    segments: tuple[Segment, ...] = ()  # mask-free fused calls covering the problem
    fwd: Schedule = field(default_factory=lambda: EMPTY_SCHEDULE)  # pieces and band groups
    # The backward's schedule when it differs from the forward's (band masks), built on
    # first use so that inference never plans it.
    bwd_build: Callable[[], Schedule] | None = None
    native_band: tuple[int, int] | None = None  # (lo, hi) for the compiled band kernel
    masked: bool = False  # the mask is evaluated on partial tiles (else every tile is full)
    mask_dims: tuple[int, int] = (1, 1)  # (b', h') the mask varies over
    block: BlockMask | None = None  # the tile plan the schedule was cut from
    # The tile plan was made from values a signature does not watch (a user's mask_mod, a
    # bool mask tensor): it serves the problem it was planned for, and a kept job plans again
    replan: bool = False
    planned: Any = None  # weak reference to that problem
    # Per call (for_run):
    call: Problem | None = None  # the problem it runs
    seed: int = 0  # dropout seed (drawn from torch's default generator)
    params: tuple[Tensor, ...] = ()  # tensors a score_mod closes over
    watch: Watch | None = None

    @functools.cached_property
    def bwd(self) -> Schedule:
        return self.fwd if self.bwd_build is None else self.bwd_build()

    def for_run(self, **per_call: Any) -> Job:
        """This job with the per-call values set (itself when they are the defaults). A copy
        of its fields, not ``dataclasses.replace`` (~12 us, and it would drop the backward
        schedule already built): a kept job is bound at every call."""
        if all(v is None or v == 0 or v == () for v in per_call.values()):
            return self
        assert _PER_CALL.issuperset(per_call), f"not per-call values: {sorted(per_call)}"
        job = object.__new__(Job)
        job.__dict__.update(self.__dict__)
        job.__dict__.update(per_call)
        return job

    def unbound(self) -> Job:
        """This job without its call (what a plan keeps); its schedules are shared."""
        planned = weakref.ref(self.call) if self.replan and self.call is not None else None
        job = replace(self, call=None, params=(), watch=None, seed=0, planned=planned)
        if "bwd" in self.__dict__:
            job.__dict__["bwd"] = self.__dict__["bwd"]
        return job

    def tiles_for(self, p: Problem) -> bool:
        """True when this job's tile plan serves ``p`` (else ``p``'s must be planned)."""
        return not self.replan or (self.planned is not None and self.planned() is p)

    def without_tiles(self) -> Job:
        """This job as a plan keeps it when its tiles are planned per call."""
        return replace(self, fwd=EMPTY_SCHEDULE, bwd_build=None, block=None, planned=None)

    @property
    def p(self) -> Problem:
        """The problem of the call this job runs."""
        assert self.call is not None, "a kept job runs bound to its call (Job.for_run(call=p))"
        return self.call

    @property
    def mask(self) -> MaskKind | None:
        """The mask evaluated on partial tiles (``None``: every tile is full)."""
        return self.p.mask if self.masked else None

    @property
    def bias(self) -> Tensor | None:
        """The 4-D float bias, or ``None``."""
        return self.p.score.bias

    @property
    def score_mod(self) -> Any:
        """The callable score_mod, or ``None``."""
        return self.p.score.score_mod

    # -- masks -------------------------------------------------------------------------

    def group_mask(
        self, g: BandGroup, device: torch.device, dtype: torch.dtype
    ) -> tuple[Tensor | None, Tensor | None]:
        """A band group's shared additive mask and its rows without keys, evaluated once
        (from the group's first row) per device and dtype."""
        got = g.masks.get((device, dtype))
        if got is not None:
            return got
        span = g.w * g.b
        q0, k0 = g.i0 * g.b, (g.i0 + g.c) * g.b
        m = self._mask_at((0, 1), (0, 1), (q0, q0 + g.b), (k0, k0 + span), device)
        m = m.expand(1, 1, g.b, span)
        fmask, dead = None, None
        if not bool(m.all()):
            fmask = torch.zeros(m.shape, dtype=dtype, device=device)
            fmask = fmask.masked_fill(~m, float("-inf"))
            rows_dead = ~m.any(dim=-1)  # [1, 1, b]
            dead = rows_dead if bool(rows_dead.any()) else None
        g.masks[(device, dtype)] = (fmask, dead)
        return fmask, dead

    def key_group_mask(
        self, g: KeyBandGroup, device: torch.device, dtype: torch.dtype
    ) -> Tensor | None:
        """A key-major group's shared additive mask ``[1, 1, w*b, b]`` (or ``None`` when
        every query of the window sees every key), evaluated once per device and dtype from
        the group's first key block."""
        if (device, dtype) in g.masks:
            return g.masks[(device, dtype)]
        rows = g.w * g.b
        q0, k0 = (g.j0 + g.c) * g.b, g.j0 * g.b
        m = self._mask_at((0, 1), (0, 1), (q0, q0 + rows), (k0, k0 + g.b), device)
        m = m.expand(1, 1, rows, g.b)
        fmask = None
        if not bool(m.all()):
            fmask = torch.zeros(m.shape, dtype=dtype, device=device)
            fmask = fmask.masked_fill(~m, float("-inf"))
        g.masks[(device, dtype)] = fmask
        return fmask

    def _mask_at(self, b: Axis, h: Axis, q: Axis, k: Axis, device: torch.device) -> Tensor:
        """The mask at a region: bool ``[nb|1, nh|1, nq|1, nk|1]``."""
        assert self.mask is not None
        m = mask_at(self.mask, b, h, q, k, device)
        assert m is not None  # a job holds no mask rather than "none"
        return m

    def piece_mask(self, pc: Piece, device: torch.device) -> Tensor | None:
        """bool ``[b', h', q1-q0, span]`` (True = may attend) or ``None`` when every key of the
        piece is visible to every row. Only the partial key blocks are evaluated."""
        if not pc.masked or self.mask is None:
            return None
        rows = pc.q1 - pc.q0
        if (
            len(pc.masked) == 1
            and pc.masked[0][0] == 0
            and pc.masked[0][2] - pc.masked[0][1] == pc.span
        ):
            return self._eval(pc, pc.key_axis(), device)
        m = torch.ones(1, 1, rows, pc.span, dtype=torch.bool, device=device)
        for off, k0, k1 in pc.masked:
            r = self._eval(pc, (k0, k1), device)
            lead = torch.broadcast_shapes(m.shape[:2], r.shape[:2])
            if tuple(m.shape[:2]) != tuple(lead):
                m = m.expand(*lead, rows, pc.span).clone()
            m[:, :, :, off : off + (k1 - k0)] = r
        return m

    def _eval(self, pc: Piece, keys: Axis, device: torch.device) -> Tensor:
        """The mask on the piece's rows against ``keys``: bool ``[b', h', rows, keys]``."""
        m = self._mask_at(*self._bh, (pc.q0, pc.q1), keys, device)
        return m.expand(m.shape[0], m.shape[1], pc.q1 - pc.q0, size(keys))

    @functools.cached_property
    def _bh(self) -> tuple[Axis, Axis]:
        """Every batch element and query head: a piece's region spans them all."""
        return (0, self.p.B), (0, self.p.Hq)

    # -- score_mod / bias ----------------------------------------------------------------

    def bias_slice(self, pc: Piece) -> Tensor | None:
        """The bias restricted to the piece: ``[Bb, Hb, rows|1, span|1]``."""
        if self.bias is None:
            return None
        return take(self.bias, *self._bh, (pc.q0, pc.q1), pc.key_axis())

    def apply_score_mod(self, s: Tensor, pc: Piece) -> Tensor:
        """A callable score_mod on the piece's scores ``s [B, Hq, rows, span]``."""
        check = self.watch.check if self.watch is not None else None
        if self.watch is not None:
            self.watch.check = None
        # The first call watches which learnable tensors the output depends on.
        call = None if check is None else functools.partial(_watched, self.score_mod, check)
        out = score_at(self.p.score, s, *self._bh, (pc.q0, pc.q1), pc.key_axis(), call=call)
        return out.expand(s.shape)

    def keep_mask(self, pc: Piece, shape: tuple[int, ...], device: torch.device) -> Tensor:
        """The dropout keep-pattern of a piece: the same in the forward and the backward."""
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed + 1_000_003 * pc.seed) % (1 << 63))
        return torch.rand(shape, generator=gen, device=device) >= self.p.dropout_p


def _watched(
    mod: Callable[..., Any], check: Callable[[Tensor, Tensor], bool], s: Tensor, *idx: Tensor
) -> Any:
    """``mod(s, *idx)`` with ``s`` made a leaf that needs a gradient, detached after;
    :class:`HiddenDependency` when ``check`` finds the output depends on a learnable tensor
    the engine does not know about."""
    with torch.enable_grad():
        s_in = s.detach().requires_grad_(True)
        out = mod(s_in, *idx)
    if isinstance(out, Tensor) and check(out, s_in):
        raise HiddenDependency
    return out.detach() if isinstance(out, Tensor) else out


def fused_ok(p: Problem) -> str | None:
    """Why torch's fused CPU flash kernel cannot run this problem's pieces, or ``None``."""
    if p.device.type not in ("cpu", "meta"):  # meta: `qkv plan` describing a CPU run
        return f"tensors are on {p.device.type} (the fused flash kernel used here is CPU-only)"
    if p.score.is_callable:
        return "a callable score_mod is applied block by block with explicit matmuls"
    if p.score.bias is not None:
        if p.score.bias.requires_grad and torch.is_grad_enabled():
            return "the bias needs a gradient, which the fused kernel does not return"
        if p.dtype in (torch.float16, torch.bfloat16):
            return "the contract adds the bias in float32; the fused kernel adds it in q's dtype"
    if p.dropout_p > 0:
        return "dropout must use the same pattern in forward and backward (explicit matmuls)"
    if p.D == 0 or p.Dv == 0:
        return "a head dim is 0"
    return None

"""The backend protocol: what every backend must say, and the route it hands the planner.

A backend answers three questions about a classified :class:`qkv._core.problem.Problem`:

- ``rejects(p)``: why it cannot compute ``p`` exactly (``None`` if it can);
- ``route(p)``: how it will compute it — a frozen :class:`Route` naming the forward and
  backward kernels, the tiles and the extra memory, and carrying what ``run`` executes;
- ``run(p, route)``: ``out [B, Hq, Lq, Dv]`` and, when ``p.return_lse``, ``lse [B, Hq, Lq]``;

and states its part of the auto policy: ``auto_skip(p)`` (why ``auto`` should not take ``p``
here although it could: slow or imprecise there) and ``claims(p)`` (why ``auto`` should take
``p`` here rather than from an earlier backend: faster there).

``route`` is called once per call, by the planner; ``qkv.plan`` prints that route and
``qkv.attention`` runs that same route, so the explanation cannot drift from what runs.
A new backend is one file implementing this class plus one line in ``backends/__init__.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._core.problem import Problem
from .._core.tracing import is_symbolic

Tensor = torch.Tensor
# A route as a function of the tensors: a Kernel always computes; a Runner may answer
# ``None``, meaning "these tensors' values need the full path" (see Backend.runner).
Kernel = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor | None]]
Runner = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor | None] | None]


class Recipe:
    """A backend's own plan of one call: what its ``run`` executes (the block-sparse
    engine's :class:`Job`, the Triton kernels' :class:`Call`, the plain formula's row chunks).
    Each backend subclasses it with a frozen dataclass and reads back only its own; it holds
    none of the call's tensors, so a plan can be kept."""


@dataclass(frozen=True, kw_only=True)
class Route:
    """How one backend computes one problem."""

    forward: str  # the forward kernel, for a person
    backward: str  # the backward kernel (autograd's, or the backend's own)
    extra_memory: int  # estimated peak bytes beyond inputs and output
    block: Any = None  # the qkv.BlockMask whose tiles it computes, when it works by tiles
    notes: tuple[str, ...] = ()
    detail: Recipe | None = None  # the backend's own plan (see :class:`Recipe`)


class Unavailable(Exception):
    """Raised by :meth:`Backend.route` when a one-off step the route needs (building a compiled
    kernel) failed: the planner passes over the backend with this message as the reason."""


class Backend(ABC):
    """The interface every backend implements (see the module docstring)."""

    name: ClassVar[str]
    # True when the backend materialises Lq x Lk scores, so the dense memory limit applies.
    materialises_scores: ClassVar[bool] = True

    @abstractmethod
    def rejects(self, p: Problem) -> str | None:
        """Why this backend cannot compute ``p`` exactly, or ``None`` if it can."""

    @abstractmethod
    def route(self, p: Problem, *, dry_run: bool = False) -> Route:
        """How this backend will compute ``p`` (only called when ``rejects(p)`` is None).
        ``dry_run`` (for :func:`qkv.plan`): decide without one-off work such as compiling a
        kernel, and attach what a person needs to see (the tile plan). Raises
        :class:`Unavailable` when that one-off work fails."""

    @abstractmethod
    def run(self, p: Problem, route: Route) -> tuple[Tensor, Tensor | None]:
        """Execute ``route``: ``out [B, Hq, Lq, Dv]`` and, when ``p.return_lse`` (else
        ``None``), ``lse [B, Hq, Lq]`` in ``p.compute_dtype`` (float64 for float64 inputs,
        else float32)."""

    def auto_skip(self, p: Problem) -> str | None:
        """Why ``backend="auto"`` should pass over this backend for ``p`` although it computes
        it exactly (slow or imprecise there, measured); ``None`` (the default) to take it."""
        return None

    def claims(self, p: Problem) -> str | None:
        """Why ``auto`` should give ``p`` to this backend rather than to any earlier backend in
        ``AUTO_ORDER`` that does not claim it too (this one is faster there, measured). Asked
        only when :meth:`rejects` is ``None``; ``None`` (the default) claims nothing."""
        return None

    def keep(self, route: Route) -> Route:
        """``route`` as a kept plan holds it for later calls of its signature: without what
        was planned from values a signature does not watch (the tiles of a user's mask_mod,
        of a bool mask tensor; ``qkv._core.kindspec.unwatched``), which ``run`` then plans per call.
        The default keeps it as it is."""
        return route

    def runner(self, p: Problem, route: Route) -> Runner | None:
        """``route`` as a function of ``(q, k, v)`` alone, for repeat calls of ``p``'s
        signature (:mod:`qkv._planning.signature`): everything but the tensors is bound once.
        ``None`` (the default) when the route holds per-call work. A runner returns what
        :meth:`run` returns (``lse`` may be given even when not asked for), or ``None`` when
        these tensors' values call for another decision (the caller then takes the full
        path)."""
        return None


def unit_last_stride(t: Tensor) -> Tensor:
    """``t`` itself when its last dim is dense (stride 1), else a contiguous copy. torch's
    fused CPU attention kernels and qkv's Triton kernels index rows with ``stride(-1) == 1``
    whatever the tensor says, so a transposed or every-other-column view (``x.mT``,
    ``x[..., ::2]``) must be copied before it reaches them. The copy is differentiable."""
    if t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


# torch's fused CPU attention kernel (aten._scaled_dot_product_flash_attention_for_cpu, which
# F.scaled_dot_product_attention runs on the CPU; torch 2.13) takes the maximum of a row's
# scores over a key span shorter than one vector with scalar code that skips NaN: a row whose
# scores are all NaN (a NaN query; a lone NaN key) reads as a row with no visible key and
# comes out as zeros. One vector is 16 floats on AVX-512, 8 on AVX2 and the default build, so
# a NaN query row over 13 keys vanished on AVX-512 only. With an attention mask the kernel
# reduces with vector code that keeps NaN: no case dropped one over Lq 1-33 x Lk 1-33 and 520,
# float32/bfloat16/float64, causal or not, hidden keys before or around the NaN, on AVX-512,
# AVX2 and the default build (tests/test_nan.py holds the kernel to both halves of this).
FUSED_NAN_SPAN = 16


def fused_cpu_mask(
    q: Tensor, lq: int, lk: int, mask: Tensor | None, causal: bool
) -> tuple[Tensor | None, bool]:
    """The ``(attn_mask, is_causal)`` to give torch's fused CPU kernel for ``lq`` query rows
    over ``lk`` keys: as given, except that a call without a mask over fewer than
    :data:`FUSED_NAN_SPAN` keys on the CPU gets an additive mask of zeros, ``[1, lk]``
    (broadcast over the rows), or with ``causal`` ``[lq, lk]`` with ``-inf`` above the diagonal
    (aligned top-left, as ``is_causal`` is), so that a NaN reaches the rows that see it. It
    costs 7-10 us a call over 8 keys (F.scaled_dot_product_attention's 35 us: RESULTS.md).
    A symbolic ``lk`` (torch.compile with dynamic shapes) always gets the mask: asking whether
    it is under 16 would guard on it and compile again when a growing KV cache passes 16."""
    if mask is not None or q.device.type != "cpu":
        return mask, causal
    if not is_symbolic(lk) and lk >= FUSED_NAN_SPAN:
        return mask, causal
    if not causal:
        return torch.zeros(1, lk, dtype=q.dtype, device=q.device), False  # [1, Lk]
    m = torch.full((lq, lk), float("-inf"), dtype=q.dtype, device=q.device)
    return m.triu(1), False  # [Lq, Lk]


# The largest extra memory (bytes) a call may need beyond its inputs: a route over it is
# refused (``qkv.set_dense_limit`` sets it). Here, not in the planner, because a backend may
# shape its route by it (the plain formula under torch.compile works in chunks within it).
DENSE_LIMIT = {"bytes": 1 << 30}

# Up to this many scores (B*Hq*Lq*Lk) a dense computation beats planning tiles (measured,
# benchmarks/RESULTS.md: H=8, window 64, document and prefix masks, SDPA 1.3-3.5x faster at
# n <= 256, blocksparse 1.6x faster at n = 512 and more beyond): under torch.compile, where
# nothing can be weighed while dynamo traces, auto gives a masked problem this small to SDPA
# with a dense mask or the plain formula, which trace, and a larger one to the engine's
# operator. Eagerly auto weighs both routes' estimated costs instead (blocksparse/cost.py).
SMALL_DENSE = 1 << 20


def small_grid(p: Problem) -> bool:
    """Whether ``p``'s score grid (``B*Hq*Lq*Lk``) has at most :data:`SMALL_DENSE` entries. A
    symbolic size (torch.compile with dynamic shapes) answers False without asking: asking
    would guard on the size, and a graph whose length grows past the limit would compile
    again (a window over lengths 160-376 at 8 heads compiled 3 times); the engine's operator
    then takes every length of that graph."""
    n = p.B * p.Hq * p.Lq * p.Lk
    return not is_symbolic(n) and n <= SMALL_DENSE


# Beyond this |logit| a backward that recomputes the scores and exponentiates them against a
# float32 lse (torch's fused SDPA backward, the Triton kernels') loses whole digits: at
# logits of ~1e4 its gradients were up to 1e5x plain float32 autograd's error (
# tests/test_contract_edges.py). The block-sparse engine redoes such rows with explicit
# matmuls; auto sends problems that may reach it there.
HUGE_LOGIT = 128.0


def logit_bound(q: Tensor, k: Tensor, scale: float) -> float:
    """An upper bound on ``|q_i · k_j| * |scale|`` over the pairs a query head meets
    (Cauchy-Schwarz per (batch, head): the largest query norm times the largest key norm of
    its kv head). ``q [B, Hq, Lq, D]``, ``k [B, Hkv, Lk, D]``; 0 for meta or empty tensors.
    One pass over q and k and one host sync: cheap beside the attention it guards.

    0 while torch.compile traces (a data-dependent branch would break the graph): compiled
    calls keep the route of ordinary logits."""
    if q.device.type == "meta" or q.numel() == 0 or k.numel() == 0:
        return 0.0
    if torch.compiler.is_compiling():
        return 0.0
    if q.device.type == "cpu" and k.device.type == "cpu" and q.dtype in _NATIVE_BOUND_DTYPES:
        op = _native_bound()
        if op is not None:  # (one call instead of eight operators: ~25 -> ~7 us when small)
            return op(q, k) * abs(scale)
    B, Hq, Hkv = q.shape[0], q.shape[1], k.shape[1]
    with torch.no_grad():  # (a half-precision norm that overflows says inf: huge, as it is)
        qn = torch.linalg.vector_norm(q, dim=-1).amax(-1).view(B, Hkv, Hq // Hkv)
        kn = torch.linalg.vector_norm(k, dim=-1).amax(-1).view(B, Hkv, 1)
        return float((qn * kn).amax()) * abs(scale)


_NATIVE_BOUND_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_NATIVE: dict[str, Any] = {}


def _native_bound() -> Any | None:
    """The band kernel library's ``logit_bound`` operator where that library is built already
    (it is not built for this: a first build takes ~15-30 s), else ``None``."""
    op = _NATIVE.get("op")
    if op is None:
        from .blocksparse.native import LIBRARY  # (here: the engine's package imports this one)

        ops = LIBRARY.ops_if_built()
        if ops is None:
            return None
        op = _NATIVE["op"] = ops.logit_bound.default
    return op


def imprecise_backward(p: Problem) -> str | None:
    """For a backend whose backward recomputes the scores against a float32 lse: why auto
    should not take ``p`` (a gradient is needed and the logits may pass :data:`HUGE_LOGIT`),
    or ``None``."""
    if not p.requires_grad():
        return None
    bound = p.reads.get("logit_bound")
    if not isinstance(bound, float):
        bound = logit_bound(p.q, p.k, p.scale)
        p.reads["logit_bound"] = bound  # (read once per problem, by any backend)
    p.reads["huge_logits"] = bound > HUGE_LOGIT  # the planner keeps the plan per answer
    if bound <= HUGE_LOGIT:
        return None
    return (
        f"logits may reach {bound:.3g} (|q|·|k|·scale); its backward recomputes them against "
        f"a float32 lse and loses precision beyond {HUGE_LOGIT:g}, where blocksparse redoes "
        f"the rows with explicit matmuls"
    )


def score_bytes(p: Problem, copies: int) -> int:
    """Bytes of ``copies`` dense ``[B, Hq, Lq, Lk]`` matrices in the compute dtype."""
    item = torch.finfo(p.compute_dtype).bits // 8
    return copies * p.B * p.Hq * p.Lq * p.Lk * item


def no_keys_result(p: Problem) -> tuple[Tensor, Tensor | None]:
    """The result of a problem without queries or keys: ``out`` zeros, ``lse`` ``-inf``
    (when asked for). ``out`` stays in autograd's graph of q, k and v, so a backward gives
    them the zero gradients the contract promises for rows that see no key."""
    out = p.q.new_zeros(p.B, p.Hq, p.Lq, p.Dv)
    inputs = [t for t in (p.q, p.k, p.v) if t.requires_grad]
    if torch.is_grad_enabled() and inputs:
        out = out + sum(t.sum() * 0 for t in inputs)
    lse = torch.full((p.B, p.Hq, p.Lq), float("-inf"), dtype=p.compute_dtype, device=p.device)
    return out, (lse if p.return_lse else None)

"""Backend choice: one frozen :class:`Plan` per call, made here and nowhere else.

``backend="auto"`` takes the first backend in ``AUTO_ORDER`` (``qkv.backends``) that
computes the problem exactly, is not passed over by the auto policy below, and fits the
dense-memory limit; the chosen backend's :class:`~qkv.backends.base.Route` says which
kernels run forward and backward. :func:`qkv.attention` executes that plan; :func:`qkv.plan`
returns the same object, so its text is what runs. Naming a backend that cannot compute the
problem is a ``ValueError`` that says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ._core.problem import Problem
from ._door import validate
from ._planning import kept, signature
from ._planning.about import About, describe
from ._planning.signature import of_call
from .backends import AUTO_ORDER, BACKENDS
from .backends.base import DENSE_LIMIT, Backend, Route, Unavailable
from .typing import MaskLike, ScoreLike

Tensor = torch.Tensor

__all__ = ["AUTO_ORDER", "BACKENDS", "Plan", "decide", "plan", "set_dense_limit"]

_limit = DENSE_LIMIT


def set_dense_limit(nbytes: int) -> int:
    """Set the largest extra memory (bytes) a call may need beyond its inputs; returns the old.

    Backends that materialise an ``Lq × Lk`` matrix are refused beyond this limit (default
    1 GiB) rather than silently allocating O(n²) memory.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"the dense limit must be a non-negative number of bytes, got {nbytes!r}")
    old = _limit["bytes"]
    _limit["bytes"] = nbytes
    return old


def dense_limit() -> int:
    """The current dense-memory limit in bytes (see :func:`set_dense_limit`)."""
    return _limit["bytes"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _too_big(b: Backend, route: Route) -> str | None:
    if not b.materialises_scores:
        return None  # O(n) memory by construction (blocksparse): the dense limit is moot
    if route.extra_memory > _limit["bytes"]:
        return (
            f"would need {_fmt_bytes(route.extra_memory)} of extra memory, over the dense limit "
            f"of {_fmt_bytes(_limit['bytes'])} (qkv.set_dense_limit raises it)"
        )
    return None


def _auto_skip(name: str, p: Problem, *, claims: bool = True) -> str | None:
    """The auto policy, as the backends state it: why ``auto`` passes over ``name`` for ``p``
    although it computes it exactly. A later backend in ``AUTO_ORDER`` that claims ``p`` (it is
    faster there) takes it from every earlier one that does not claim it too; otherwise the
    backend's own reasons (slow or imprecise there)."""
    b = BACKENDS[name]
    if claims and b.claims(p) is None:
        for later in AUTO_ORDER[AUTO_ORDER.index(name) + 1 :]:
            other = BACKENDS[later]
            if other.rejects(p) is None and (why := other.claims(p)) is not None:
                return why
    return b.auto_skip(p)


def _check_backend_name(name: object) -> str:
    valid = ["auto", *BACKENDS]
    if not isinstance(name, str) or name not in valid:
        raise ValueError(f"unknown backend {name!r}; valid backends are {valid}")
    return name


@dataclass(frozen=True, kw_only=True, eq=False)
class Plan:
    """What :func:`qkv.attention` does for one problem: the backend, its forward and backward
    kernels, why the other backends were passed over, and the cost. ``str(plan)`` explains
    it. A plan holds none of the call's tensors: :func:`qkv.attention` keeps it under the
    call's signature (``qkv._planning.signature``) and runs it on the next call of that
    signature with that call's tensors."""

    backend: str
    forward: str  # the forward kernel
    backward: str  # the backward kernel (runs only when gradients are needed)
    rejected: dict[str, str]
    extra_memory: int  # estimated peak bytes beyond inputs and output
    route_notes: tuple[str, ...] = ()  # the backend's own remarks on its route
    route: Route = field(repr=False)
    # what qkv.plan shows beyond the decision (computed there, from the call's values)
    about: About | None = field(default=None, repr=False)

    def execute(self, p: Problem) -> tuple[Tensor, Tensor | None]:
        """Run this plan on ``p`` (a problem of the signature it was decided for): ``out [B,
        Hq, Lq, Dv]`` and ``lse [B, Hq, Lq]`` (or ``None``)."""
        return BACKENDS[self.backend].run(p, self.route)

    # -- description (qkv.plan) --------------------------------------------------------------

    def _about(self) -> About:
        if self.about is None:
            raise AttributeError(
                "this plan was made to run a call, not to show one; qkv.plan(q, k, v, ...) "
                "returns the same decision with its description"
            )
        return self.about

    @property
    def shape(self) -> dict[str, int]:
        return dict(self._about().shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._about().dtype

    @property
    def mask(self) -> str:
        return self._about().mask

    @property
    def score_mod(self) -> str:
        return self._about().score_mod

    @property
    def density(self) -> float | None:
        """Fraction of (query, key) pairs the mask lets through; None when unknown cheaply."""
        return self._about().density

    @property
    def block_density(self) -> float | None:
        """Share of the score matrix inside the visible tiles the backend computes."""
        bm = self.route.block
        return None if bm is None else float(bm.block_density())

    @property
    def tiles(self) -> str | None:
        return self._about().tiles

    @property
    def flops(self) -> float:
        """Multiply-adds x2 over the unmasked pairs (forward); over every position of the
        visible tiles when the exact density is unknown."""
        s = self.shape
        share = self.density if self.density is not None else self.block_density
        pairs = s["B"] * s["Hq"] * s["Lq"] * s["Lk"] * (1.0 if share is None else share)
        return 2.0 * pairs * (s["D"] + s["Dv"])

    @property
    def notes(self) -> list[str]:
        """Everything worth saying beyond the lines above: the backend's remarks, what is
        not known about the mask's density, mods evaluated through vmap and their cost (a
        score_mod not called yet is decided by qkv.plan, on a few real positions)."""
        notes = list(self.route_notes)
        if self.density is None and self.block_density is not None:
            notes.append("exact mask density unknown; FLOPs count every position of visible tiles")
        elif self.density is None:
            notes.append("mask density unknown without evaluating the mask; FLOPs assume dense")
        return notes + list(self._about().mod_notes) + list(self._about().kernel_notes)

    def __str__(self) -> str:
        notes = self.notes
        s = self.shape
        dens = "unknown" if self.density is None else f"{self.density:.1%}"
        lines = [
            f"qkv plan: backend {self.backend!r} ({self.forward})",
            f"  problem : B={s['B']} Hq={s['Hq']} Hkv={s['Hkv']} Lq={s['Lq']} Lk={s['Lk']} "
            f"D={s['D']} Dv={s['Dv']} {str(self.dtype).replace('torch.', '')}",
            f"  mask    : {self.mask} (density {dens})",
            *([f"  tiles   : {self.tiles}"] if self.tiles else []),
            f"  score   : {self.score_mod}",
            f"  backward: {self.backward}",
            f"  cost    : {self.flops / 1e9:.3f} GFLOP forward, "
            f"~{_fmt_bytes(self.extra_memory)} extra memory",
        ]
        if self.rejected:
            lines.append("  passed over:")
            lines += [f"    {n}: {why}" for n, why in self.rejected.items()]
        lines += [f"  note: {n}" for n in notes]
        return "\n".join(lines)


def decide(p: Problem, backend: object = "auto", *, dry_run: bool = False) -> Plan:
    """The plan for a validated problem: which backend, which kernels, why not the others.
    A plan decided for a problem with a signature (``qkv._planning.signature``) is kept
    under it, and a later problem of the same signature gets it without a decision.
    ``dry_run`` (for :func:`qkv.plan`) builds nothing that takes long (no compiler), keeps
    nothing and describes the call."""
    if dry_run:
        plan = _decide(p, backend, dry_run=True)
        return replace(plan, about=describe(p, plan.route, plan.backend))
    sig = signature.of_problem(p, backend, _limit["bytes"])
    if sig is not None:
        got = kept.lookup(sig, p.q, p.k)
        if got is not None:
            return got.plan
    plan = _decide(p, backend, dry_run=False)
    if sig is not None:
        kept.keep(sig, plan, p)
    return plan


def repeat(
    q: object,
    k: object,
    v: object,
    mask: object,
    scale: object,
    return_lse: bool,
    backend: object,
) -> tuple[Tensor, Tensor | None] | None:
    """A repeat call of :func:`qkv.attention` (4-D tensors, no score_mod, no dropout) run by
    the runner of the plan kept for its signature, before any check: ``(out, lse)``, or
    ``None`` when there is none (the caller then takes the full path)."""
    sig = of_call(q, k, v, mask, scale, return_lse, backend, _limit["bytes"])
    if sig is None:
        return None
    got = kept.lookup(sig, q, k)  # type: ignore[arg-type]
    if got is None or got.runner is None:
        return None
    return got.runner(q, k, v)  # type: ignore[arg-type]


def _decide(p: Problem, backend: object, *, dry_run: bool) -> Plan:
    name = _check_backend_name(backend)
    rejected: dict[str, str] = {}
    if name != "auto":
        b = BACKENDS[name]
        why = b.rejects(p)
        if why is None:
            route, why = _route(b, p, dry_run)
        if why is not None:
            raise ValueError(f"backend {name!r} cannot compute this problem: {why}")
        others = {n: "not requested (backend was named explicitly)" for n in BACKENDS if n != name}
        return _plan(b, route, others)
    # Claims are preferences: when the backend that claimed a problem cannot take it after all
    # (over the dense limit, a failed build), a second pass ignores them.
    for claims in (True, False):
        rejected = {}
        for n in AUTO_ORDER:
            b = BACKENDS[n]
            why = b.rejects(p) or _auto_skip(n, p, claims=claims)
            if why is None:
                route, why = _route(b, p, dry_run)
                if why is None:
                    return _plan(b, _weighed(p, b, route), rejected)
            rejected[n] = why
    lines = "; ".join(f"{n}: {w}" for n, w in rejected.items())
    raise ValueError(f"no backend can compute this problem within the limits ({lines})")


def _route(b: Backend, p: Problem, dry_run: bool) -> tuple[Route, str | None]:
    """The backend's route, or why it cannot take it after all (a failed kernel build, or
    over the dense limit)."""
    try:
        route = b.route(p, dry_run=dry_run)
    except Unavailable as e:
        return _NO_ROUTE, str(e)
    return route, _too_big(b, route)


def _weighed(p: Problem, b: Backend, route: Route) -> Route:
    """``route`` with what a later backend said when it weighed ``p`` and left it to ``b``
    (``p.reads["declined"]``: its name and the estimated costs), among its notes."""
    declined = p.reads.get("declined")
    if not isinstance(declined, tuple) or declined[0] == b.name:
        return route
    return replace(route, notes=(*route.notes, f"auto kept {b.name}: {declined[1]}"))


_NO_ROUTE = Route(forward="", backward="", extra_memory=0)


def _plan(b: Backend, route: Route, rejected: dict[str, str]) -> Plan:
    return Plan(
        backend=b.name,
        forward=route.forward,
        backward=route.backward,
        rejected=rejected,
        extra_memory=route.extra_memory,
        route_notes=route.notes,
        route=route,
    )


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskLike = None,
    *,
    score_mod: ScoreLike = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
) -> Plan:
    """Say which backend :func:`qkv.attention` would run for these arguments, and why.

    Takes exactly the arguments of :func:`qkv.attention` (shapes ``q [B, Hq, Lq, D]``,
    ``k [B, Hkv, Lk, D]``, ``v [B, Hkv, Lk, Dv]``) and computes nothing but the plan (meta
    tensors work: nothing is allocated). Its notes also say which of the user's mods run
    through ``torch.vmap`` (with their cost, measured now) and which ``torch.compile``
    cannot trace (the line ``fullgraph=True`` refuses them with; asked by compiling the mod
    alone once, about 0.1 s, plus dynamo's import the first time).

    Example::

        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 2, 64, 8)
        >>> qkv.plan(q, k, v, mask=qkv.causal).backend
        'sdpa'
    """
    p = validate(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        dropout_p=dropout_p,
        return_lse=return_lse,
    )
    return decide(p, backend, dry_run=True)

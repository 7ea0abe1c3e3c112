"""Backend choice: which backend computes a problem, why the others were rejected, and what
it costs.

``backend="auto"`` takes the first backend in :data:`AUTO_ORDER` that computes the problem
exactly and fits the dense-memory limit. Naming a backend that cannot compute the problem is
a ``ValueError`` that says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._flexplan import plan_notes
from ._validate import Problem, validate
from .backends._base import Backend
from .backends.blocksparse import BlocksparseBackend
from .backends.reference import ReferenceBackend
from .backends.sdpa import SdpaBackend
from .blockmask import BlockMask, for_problem
from .masks import _Band, causal

Tensor = torch.Tensor

BACKENDS: dict[str, Backend] = {
    b.name: b for b in (SdpaBackend(), BlocksparseBackend(), ReferenceBackend())
}
# sdpa first where the problem maps onto torch's kernel directly (no mask, causal, a bias);
# blocksparse for everything else (masks, score_mods, lse); the reference as the last resort.
AUTO_ORDER: list[str] = ["sdpa", "blocksparse", "reference"]

_limit = {"bytes": 1 << 30}


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


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _too_big(b: Backend, p: Problem) -> str | None:
    if not getattr(b, "materialises_scores", True):
        return None  # O(n) memory by construction (blocksparse): the dense limit is moot
    need = b.extra_memory(p)
    if need > _limit["bytes"]:
        return (
            f"would need {_fmt_bytes(need)} of extra memory, over the dense limit of "
            f"{_fmt_bytes(_limit['bytes'])} (qkv.set_dense_limit raises it)"
        )
    return None


def _check_backend_name(name: object) -> str:
    valid = ["auto", *BACKENDS]
    if not isinstance(name, str) or name not in valid:
        raise ValueError(f"unknown backend {name!r}; valid backends are {valid}")
    return name


# Below this many scores (B*Hq*Lq*Lk) a masked problem goes to SDPA with a dense mask: its
# one fused call beats planning tiles (measured, benchmarks/RESULTS.md: H=8, window 64,
# document and prefix masks, SDPA 1.3-3.5x faster at n <= 256, blocksparse 1.6x faster at
# n = 512 and more beyond).
_SMALL_DENSE = 1 << 20


def _auto_skip(name: str, p: Problem) -> str | None:
    """Why ``auto`` passes over a backend that could compute ``p`` but not well."""
    masked = p.mask is not None and p.mask is not causal
    if name == "sdpa" and masked and p.B * p.Hq * p.Lq * p.Lk > _SMALL_DENSE:
        return (
            "SDPA would get this mask as a dense [Lq, Lk] tensor and do all Lq*Lk work; "
            "blocksparse skips the hidden blocks"
        )
    if name == "sdpa" and masked and _native_band_runs(p):
        # Measured (benchmarks/RESULTS.md): faster than the SDPA route (which evaluates the
        # mask into a dense tensor every call) at every size, 1.2x at n=64 to 2.6x at 256.
        return (
            "SDPA would do all Lq*Lk work on a dense mask evaluated every call; qkv's "
            "compiled band kernel computes only the band, faster at every size measured"
        )
    return None


def _native_band_runs(p: Problem) -> bool:
    from .backends._blocksparse_plan import native_band
    from .blockmask import BlockMask

    mask = p.mask.mask if isinstance(p.mask, BlockMask) else p.mask
    return native_band(p, mask, build=False) is None


def select(p: Problem, backend: object) -> tuple[Backend, dict[str, str]]:
    """The backend that will run ``p`` and the reasons the others were passed over."""
    name = _check_backend_name(backend)
    rejected: dict[str, str] = {}
    if name != "auto":
        b = BACKENDS[name]
        why = b.rejects(p) or _too_big(b, p)
        if why is not None:
            raise ValueError(f"backend {name!r} cannot compute this problem: {why}")
        return b, {n: "not requested (backend was named explicitly)" for n in BACKENDS if n != name}
    for n in AUTO_ORDER:
        b = BACKENDS[n]
        why = b.rejects(p) or _auto_skip(n, p) or _too_big(b, p)
        if why is None:
            return b, rejected
        rejected[n] = why
    lines = "; ".join(f"{n}: {w}" for n, w in rejected.items())
    raise ValueError(f"no backend can compute this problem within the limits ({lines})")


@dataclass
class Plan:
    """What :func:`qkv.attention` would do for a problem. ``str(plan)`` explains it."""

    backend: str
    kernel: str
    rejected: dict[str, str]
    shape: dict[str, int]
    dtype: torch.dtype
    mask: str
    score_mod: str
    density: float | None  # fraction of (query, key) pairs the mask lets through
    flops: float  # multiply-adds x2 over the unmasked pairs (forward)
    extra_memory: int  # estimated peak bytes beyond inputs and output
    notes: list[str] = field(default_factory=list)
    # Fraction of the score matrix inside visible tiles of the block mask (the share of the
    # dense work the blocksparse backend does), and a summary of the tiles; None without one.
    block_density: float | None = None
    tiles: str | None = None

    def __str__(self) -> str:
        s = self.shape
        dens = "unknown" if self.density is None else f"{self.density:.1%}"
        lines = [
            f"qkv plan: backend {self.backend!r} ({self.kernel})",
            f"  problem : B={s['B']} Hq={s['Hq']} Hkv={s['Hkv']} Lq={s['Lq']} Lk={s['Lk']} "
            f"D={s['D']} Dv={s['Dv']} {str(self.dtype).replace('torch.', '')}",
            f"  mask    : {self.mask} (density {dens})",
            *([f"  tiles   : {self.tiles}"] if self.tiles else []),
            f"  score   : {self.score_mod}",
            f"  cost    : {self.flops / 1e9:.3f} GFLOP forward, "
            f"~{_fmt_bytes(self.extra_memory)} extra memory",
        ]
        if self.rejected:
            lines.append("  passed over:")
            lines += [f"    {n}: {why}" for n, why in self.rejected.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _describe(obj: object, kind: str) -> str:
    if obj is None:
        return "none"
    if isinstance(obj, Tensor):
        what = "bool tensor" if kind == "mask" else "bias tensor"
        return f"{what} {list(obj.shape)}"
    return (
        repr(obj)
        if type(obj).__module__.startswith("qkv")
        else getattr(obj, "__name__", type(obj).__name__)
    )


def _density(p: Problem) -> float | None:
    """Exact fraction of visible pairs for band masks and tensors; None when unknown cheaply."""
    m, n = p.mask, p.Lq * p.Lk
    if m is None:
        return 1.0
    if n == 0:
        return 0.0
    if isinstance(m, BlockMask):
        m = m.mask
    if isinstance(m, Tensor):
        if m.device.type == "meta":
            return None
        return float(m.expand(p.shape).float().mean()) if m.numel() else 0.0
    if isinstance(m, _Band):
        i = torch.arange(p.Lq, dtype=torch.float64)
        lo = (i + (m.lo if m.lo is not None else -p.Lk)).clamp(0, p.Lk)
        hi = (i + (m.hi if m.hi is not None else p.Lk) + 1).clamp(0, p.Lk)
        return float((hi - lo).clamp(min=0).sum()) / n
    return None


def explain(p: Problem, backend: object = "auto") -> Plan:
    """Build the :class:`Plan` for a validated problem."""
    b, rejected = select(p, backend)
    density = _density(p)
    block_density, tiles = None, None
    if b.name == "blocksparse" and p.mask is not None:
        bm = for_problem(p)
        assert bm is not None
        block_density = bm.block_density()
        n = bm.num_blocks
        bq, bk = bm.block_size
        tiles = (
            f"{n['full'] + n['partial']} of {bm.states.numel()} tiles of {bq}x{bk} computed "
            f"({n['partial']} partial), {block_density:.1%} of the dense work"
        )
        if bm.evaluated:
            where = "on meta tensors (no data)" if p.device.type == "meta" else "tile by tile"
            tiles += f"; evaluated {where}: {', '.join(bm.evaluated)}"
    pairs = p.B * p.Hq * p.Lq * p.Lk * (1.0 if density is None else density)
    kernel = b.kernel(p) if hasattr(b, "kernel") else "materialises the full score matrix"
    notes = []
    if b.name == "reference":
        notes.append("the reference materialises all Lq x Lk scores: O(n^2) memory")
    if density is None and block_density is not None:
        pairs = p.B * p.Hq * p.Lq * p.Lk * block_density
        notes.append("exact mask density unknown; FLOPs count every position of visible tiles")
    elif density is None:
        notes.append("mask density unknown without evaluating the mask; FLOPs assume dense")
    notes += plan_notes(p)  # mods evaluated through torch.vmap, and what that costs
    return Plan(
        backend=b.name,
        kernel=kernel,
        rejected=rejected,
        shape={"B": p.B, "Hq": p.Hq, "Hkv": p.Hkv, "Lq": p.Lq, "Lk": p.Lk, "D": p.D, "Dv": p.Dv},
        dtype=p.dtype,
        mask=_describe(p.mask, "mask"),
        score_mod=_describe(p.score_mod, "score"),
        density=density,
        flops=2.0 * pairs * (p.D + p.Dv),
        extra_memory=b.extra_memory(p),
        notes=notes,
        block_density=block_density,
        tiles=tiles,
    )


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: object = None,
    score_mod: object = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
) -> Plan:
    """Say which backend :func:`qkv.attention` would run for these arguments, and why.

    Takes exactly the arguments of :func:`qkv.attention` (shapes ``q [B, Hq, Lq, D]``,
    ``k [B, Hkv, Lk, D]``, ``v [B, Hkv, Lk, Dv]``) and computes nothing but the plan.

    Example::

        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 2, 16, 8)
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
    return explain(p, backend)

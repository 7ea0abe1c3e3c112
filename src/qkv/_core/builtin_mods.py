"""The built-in masks' classes: :mod:`qkv.masks` makes them (``qkv.causal``,
``qkv.sliding_window(64)``, ``qkv.padding(lengths)``, ...). Each class carries its own rules,
so that no other module switches on what a mask is:

- its formula: a callable in FlexAttention's convention (``mask_mod(b, h, q_idx, kv_idx)``);
- its value: equal and hashed by its parameters (:class:`~qkv._core.value.Value`), the key
  under which a call's decision is kept;
- its terms (:meth:`BuiltinMask.terms`): what the kernels read (a band, a prefix, a key range
  per batch element, document ids; :mod:`qkv._core.terms`);
- its tile rule (:meth:`BuiltinMask.tile_states`): which tiles are full, partial or empty,
  from its parameters alone;
- its spec (:meth:`BuiltinMask.spec` and ``from_spec``): how it crosses a custom operator
  under ``torch.compile`` (:mod:`qkv._core.spec`);
- what it carries (:meth:`BuiltinMask.carried`): the tensors ``qkv.distributed`` compares
  across ranks; and its check against a problem's sizes (``_check_problem``).
"""

from __future__ import annotations

import torch

from .grid import FULL, Grid, band_states, below_states, document_states
from .spec import number, read, registered, slot
from .terms import NONE, Keys, Terms
from .tracing import is_symbolic
from .value import Value

Tensor = torch.Tensor


class BuiltinMask(Value):
    """Base of the built-in mask_mods: callable, printable, checked against the problem."""

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        """Raise ValueError if this mask cannot describe a ``[B, H, Lq, Lk]`` problem."""

    def carried(self) -> list[tuple[str, object]]:
        """What this mask holds beyond its name, as ``(what, value)``: its tensors (ids,
        lengths) and, for a combination, its parts. ``qkv.distributed`` compares them across
        ranks; the per-device copies a mask keeps are not part of it."""
        return []

    def tile_states(self, g: Grid) -> Tensor | None:
        """Its tile rule: int8 states (empty 0, partial 1, full 2) broadcastable to
        ``[B, H, nq, nk]`` for the tiling ``g``, from its parameters and the block bounds
        alone (no position evaluated); ``None`` when it has none (it is then evaluated)."""
        return None

    def terms(self) -> Terms:
        """The terms kernels read (:mod:`qkv._core.terms`); by default none: the mask is
        rest, evaluated position by position where a kernel needs positions."""
        return Terms(rest=(self,))

    def spec(self, tensors: list[Tensor]) -> str | None:
        """Its spec (:mod:`qkv._core.spec`), its tensors appended to ``tensors``; ``None``
        when it cannot cross a custom operator (it holds a user's mask_mod)."""
        return None

    @property
    def __name__(self) -> str:  # error messages name a mask_mod by __name__
        return repr(self)


@registered("causal", "band")
class Band(BuiltinMask):
    """Attend iff ``lo <= kv_idx - q_idx <= hi`` (``None`` = unbounded on that side)."""

    plain = True

    def __init__(self, lo: int | None, hi: int | None, name: str) -> None:
        self.lo, self.hi, self._name = lo, hi, name

    def params(self) -> tuple[object, ...]:
        return (self.lo, self.hi)  # (the name is how it was written, not what it is)

    def tile_states(self, g: Grid) -> Tensor:
        return band_states(self.lo, self.hi, g)

    def terms(self) -> Terms:
        return NONE if self.lo is None and self.hi is None else Terms(band=(self.lo, self.hi))

    def spec(self, tensors: list[Tensor]) -> str:
        if self.lo is None and _is_zero(self.hi):
            return "causal"
        return f"band({number(self.lo, tensors)},{number(self.hi, tensors)})"

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> Band:
        if not args:
            return CAUSAL
        lo, hi = (read(a, tensors) for a in args.split(","))
        return Band(lo, hi, Band.named(lo, hi))

    @staticmethod
    def named(lo: int | None, hi: int | None) -> str:
        """How a band made by simplification (or read back from a spec) is named."""
        if lo is not None and lo <= 0 and hi is not None and hi >= 0:
            return f"qkv.sliding_window({-lo})" if hi == 0 else f"qkv.sliding_window({-lo}, {hi})"
        return f"band [{lo}, {hi}] of kv_idx - q_idx"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = kv_idx - q_idx
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            return (d >= lo) & (d <= hi)
        if hi is not None:
            return d <= hi
        if lo is not None:
            return d >= lo
        return torch.ones_like(d, dtype=torch.bool)

    def __repr__(self) -> str:
        return self._name


def _is_zero(x: int | None) -> bool:
    return x is not None and x == 0


# qkv.causal itself (qkv.masks documents it): the band 0 <= q_idx - kv_idx
CAUSAL = Band(None, 0, "qkv.causal")


@registered("pad")
class KvBelow(BuiltinMask):
    """Attend iff ``start <= kv_idx < limit``: ``limit`` an int or a per-batch ``[B]`` tensor;
    ``start`` ``None`` (0) or a per-batch ``[B]`` tensor (left padding)."""

    def __init__(
        self,
        limit: int | Tensor,
        name: str | None,
        start: Tensor | None = None,
        given: tuple[Tensor | int | None, ...] | None = None,
    ) -> None:
        # name None: a padding mask, named from its tensors when first shown (reading their
        # values inside a compiled function would break the graph)
        self.limit, self._name_of, self.start = limit, name, start
        # the tensors as the caller gave them (qkv.padding's lengths and start, before the
        # ends were computed from them): what makes two such masks equal
        self.given = given if given is not None else (limit, start)
        # copies per device, with the version of the tensor they copied: an in-place edit of
        # the lengths makes a new copy instead of leaving a stale one
        self._by_device: dict[tuple[str, torch.device], tuple[int, Tensor]] = {}

    def _on(self, what: str, t: Tensor, device: torch.device) -> Tensor:
        if torch.compiler.is_compiling() or t.is_inference():
            # traced once (a version is symbolic there); inference tensors have no version
            return t.to(device=device, dtype=torch.int64)
        got = self._by_device.get((what, device))
        if got is None or got[0] != t._version:
            got = (t._version, t.to(device=device, dtype=torch.int64))
            self._by_device[(what, device)] = got
        return got[1]

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if isinstance(self.limit, int):
            ok = kv_idx < self.limit
        else:
            ok = kv_idx < self._on("limit", self.limit, kv_idx.device)[b]
        if self.start is not None:
            ok = ok & (kv_idx >= self._on("start", self.start, kv_idx.device)[b])
        return ok

    def params(self) -> tuple[object, ...]:
        return self.given

    def tile_states(self, g: Grid) -> Tensor:
        return below_states(self.limit, g, self.start)

    def terms(self) -> Terms:
        return Terms(keys=Keys(self.limit, self.start))

    def spec(self, tensors: list[Tensor]) -> str:
        lim = (
            slot(self.limit, tensors)
            if isinstance(self.limit, Tensor)
            else number(self.limit, tensors)
        )
        start = "-" if self.start is None else slot(self.start, tensors)
        return f"pad({lim},{start})"

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> KvBelow:
        lim, start = (read(a, tensors) for a in args.split(","))
        return KvBelow(lim, "padding", start)

    def carried(self) -> list[tuple[str, object]]:
        ends = "padding lengths" if self.start is None else "padding ends (start + lengths)"
        return [(ends, self.limit), ("padding starts", self.start)]

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        if isinstance(self.limit, Tensor) and self.limit.shape[0] != B:
            raise ValueError(
                f"{self._name} has {self.limit.shape[0]} lengths but the batch size is {B}; "
                f"give one key length per batch element"
            )

    @property
    def _name(self) -> str:
        if self._name_of is not None:
            return self._name_of
        assert isinstance(self.limit, Tensor)
        if self.start is None:
            return f"qkv.padding({self.limit.tolist()})"
        lengths = (self.limit - self.start).tolist()
        return f"qkv.padding({lengths}, start={self.start.tolist()})"

    def __repr__(self) -> str:
        return self._name


@registered("doc")
class Document(BuiltinMask):
    """Attend iff ``ids[q_idx] == ids[kv_idx]`` (ids ``[L]`` or ``[1, L]``, one packing for
    every batch element) or ``ids[b, q_idx] == ids[b, kv_idx]`` (ids ``[B, L]``, each batch
    element its own packing)."""

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids  # as given: the value (compared by identity), and what its spec carries
        # copies per device, with the version of the ids they copied (see KvBelow._on)
        self._by_device: dict[torch.device, tuple[int, Tensor]] = {}

    @property
    def rows(self) -> Tensor:
        """The ids as ``[R, L]``: one row per batch element, or ``R = 1`` for one row that
        every batch element shares (a view of the ids as given)."""
        return self.ids if self.ids.ndim == 2 else self.ids.unsqueeze(0)  # [R, L]

    def _rows(self, device: torch.device) -> Tensor:
        if torch.compiler.is_compiling() or self.ids.is_inference():  # (see KvBelow._on)
            return self.rows.to(device)
        got = self._by_device.get(device)
        if got is None or got[0] != self.ids._version:
            got = (self.ids._version, self.rows.to(device))
            self._by_device[device] = got
        return got[1]

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        rows = self._rows(q_idx.device)  # [R, L]
        if rows.shape[0] == 1:
            ids = rows[0]  # [L]
            return ids[q_idx] == ids[kv_idx]  # [1, 1, Lq, Lk]
        return rows[b, q_idx] == rows[b, kv_idx]  # [B, 1, Lq, Lk]

    def params(self) -> tuple[object, ...]:
        return (self.ids,)

    def tile_states(self, g: Grid) -> Tensor:
        return document_states(self.rows, g)

    def terms(self) -> Terms:
        return Terms(ids=self.rows)

    def spec(self, tensors: list[Tensor]) -> str:
        return f"doc({slot(self.ids, tensors)})"

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> Document:
        return Document(read(args, tensors))

    def carried(self) -> list[tuple[str, object]]:
        return [("document ids", self.ids)]

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        rows, n = self.rows.shape
        if rows != 1 and rows != B:
            raise ValueError(
                f"qkv.document ids has shape {list(self.ids.shape)}: {rows} rows but the batch "
                f"size is {B}; give one row of ids per batch element ([{B}, L]), or one row "
                f"([L] or [1, L]) that every batch element shares (qkv.block_mask of ids per "
                f"row needs its B, not None)"
            )
        if n < max(Lq, Lk):
            per_row = "" if self.ids.ndim == 1 else f" per row (shape {list(self.ids.shape)})"
            raise ValueError(
                f"qkv.document ids has {n} entries{per_row} but q_len={Lq} and kv_len={Lk}; "
                f"the ids must cover max(q_len, kv_len) = {max(Lq, Lk)} positions"
            )

    def __repr__(self) -> str:
        # (a size symbolic while dynamo traces is written "?": a name must be a constant)
        sizes = " x ".join("?" if is_symbolic(n) else str(n) for n in self.ids.shape)
        return f"qkv.document(<{sizes} ids>)"


@registered("prefix")
class Prefix(BuiltinMask):
    """``qkv.prefix_lm(P)``: attend iff ``kv_idx < P`` or causal."""

    plain = True

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def params(self) -> tuple[object, ...]:
        return (self.limit,)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx < self.limit) | (kv_idx <= q_idx)

    def tile_states(self, g: Grid) -> Tensor:
        return torch.maximum(below_states(self.limit, g), band_states(None, 0, g))

    def terms(self) -> Terms:
        return Terms(prefix=self.limit)

    def spec(self, tensors: list[Tensor]) -> str:
        return f"prefix({number(self.limit, tensors)})"

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> Prefix:
        return Prefix(read(args, tensors))

    def __repr__(self) -> str:
        return f"qkv.prefix_lm({self.limit})"


@registered("none")
class AllTrue(BuiltinMask):
    """No mask: every position may attend."""

    plain = True

    def params(self) -> tuple[object, ...]:
        return ()

    def tile_states(self, g: Grid) -> Tensor:
        return torch.full((1, 1, g.nq, g.nk), FULL, dtype=torch.int8)

    def terms(self) -> Terms:
        return NONE

    def spec(self, tensors: list[Tensor]) -> str:
        return "none"

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> None:
        return None

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        shape = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        return torch.ones((), dtype=torch.bool, device=q_idx.device).expand(shape)

    def __repr__(self) -> str:
        return "none"


@registered("tensor")
class TensorMask(BuiltinMask):
    """A bool tensor ``[B|1, H|1, Lq|1, Lk|1]`` (True = attend) seen as a mask_mod. Its
    values are read where positions are needed: its terms are rest."""

    def __init__(self, t: Tensor) -> None:
        self.t = t

    def params(self) -> tuple[object, ...]:
        return (self.t,)

    def spec(self, tensors: list[Tensor]) -> str:
        return f"tensor({slot(self.t, tensors)})"

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> Tensor:
        return read(args, tensors)  # the tensor itself, as a mask= argument

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        idx = [
            i if n > 1 else torch.zeros_like(i)
            for i, n in zip((b, h, q_idx, kv_idx), self.t.shape, strict=True)
        ]
        return self.t[idx[0], idx[1], idx[2], idx[3]]

    def __repr__(self) -> str:
        return f"bool tensor {list(self.t.shape)}"

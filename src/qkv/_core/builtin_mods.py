"""The built-in masks' and scores' classes: :mod:`qkv.masks` and :mod:`qkv.scores` make them
(``qkv.causal``, ``qkv.sliding_window(64)``, ``qkv.alibi(slopes)``, ...), and the door reads
their structure (:mod:`qkv._core.kinds`: a band of diagonals, a prefix of keys, equal document
ids, a slope per head) so that planning needs no evaluation of positions.

Each is a callable in FlexAttention's convention (``mask_mod(b, h, q_idx, kv_idx)``,
``score_mod(score, b, h, q_idx, kv_idx)``), printable by the call that made it, and checks
itself against a problem's sizes (``_check_problem``).
"""

from __future__ import annotations

from typing import Any

import torch

from .checks import check_mask_result
from .grid import Grid, band_states, below_states, document_states
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

    @property
    def __name__(self) -> str:  # error messages name a mask_mod by __name__
        return repr(self)


class Band(BuiltinMask):
    """Attend iff ``lo <= kv_idx - q_idx <= hi`` (``None`` = unbounded on that side)."""

    plain = True

    def __init__(self, lo: int | None, hi: int | None, name: str) -> None:
        self.lo, self.hi, self._name = lo, hi, name

    def params(self) -> tuple[object, ...]:
        return (self.lo, self.hi)  # (the name is how it was written, not what it is)

    def tile_states(self, g: Grid) -> Tensor:
        return band_states(self.lo, self.hi, g)

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


# qkv.causal itself (qkv.masks documents it): the band 0 <= q_idx - kv_idx
CAUSAL = Band(None, 0, "qkv.causal")


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


class Document(BuiltinMask):
    """Attend iff ``ids[q_idx] == ids[kv_idx]``."""

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids
        # copies per device, with the version of the ids they copied (see KvBelow._on)
        self._by_device: dict[torch.device, tuple[int, Tensor]] = {}

    def _ids(self, device: torch.device) -> Tensor:
        if torch.compiler.is_compiling() or self.ids.is_inference():  # (see KvBelow._on)
            return self.ids.to(device)
        got = self._by_device.get(device)
        if got is None or got[0] != self.ids._version:
            got = (self.ids._version, self.ids.to(device))
            self._by_device[device] = got
        return got[1]

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        ids = self._ids(q_idx.device)
        return ids[q_idx] == ids[kv_idx]

    def params(self) -> tuple[object, ...]:
        return (self.ids,)

    def tile_states(self, g: Grid) -> Tensor:
        return document_states(self.ids, g)

    def carried(self) -> list[tuple[str, object]]:
        return [("document ids", self.ids)]

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        n = self.ids.shape[0]
        if n < max(Lq, Lk):
            raise ValueError(
                f"qkv.document ids has {n} entries but q_len={Lq} and kv_len={Lk}; the ids "
                f"must cover max(q_len, kv_len) = {max(Lq, Lk)} positions"
            )

    def __repr__(self) -> str:
        return f"qkv.document(<{self.ids.shape[0]} ids>)"


class Combined(BuiltinMask):
    def __init__(self, mods: tuple[Any, ...], name: str) -> None:
        self.mods, self._name = mods, name

    def params(self) -> tuple[object, ...]:
        return self.mods

    @staticmethod
    def combine_states(a: Tensor, b: Tensor) -> Tensor:
        """Two parts' tile states combined (and: the minimum, or: the maximum)."""
        raise NotImplementedError

    def tile_states(self, g: Grid) -> Tensor | None:
        """Its parts' rules combined, when every part has one (``qkv.prefix_lm`` is the or
        of a key prefix and causal)."""
        out: Tensor | None = None
        for m in self.mods:
            part = m.tile_states(g) if isinstance(m, BuiltinMask) else None
            if part is None:
                return None
            out = part if out is None else self.combine_states(out, part)
        return out

    def carried(self) -> list[tuple[str, object]]:
        return [("part", m) for m in self.mods]

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        for m in self.mods:
            check = getattr(m, "_check_problem", None)
            if check is not None:
                check(B, H, Lq, Lk)

    def __repr__(self) -> str:
        return self._name


class And(Combined):
    @staticmethod
    def combine_states(a: Tensor, b: Tensor) -> Tensor:
        return torch.minimum(a, b)  # empty if any part is empty, full only if every part is

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = call_mod(self.mods[0], b, h, q_idx, kv_idx)
        for m in self.mods[1:]:
            out = out & call_mod(m, b, h, q_idx, kv_idx)
        return out


class Or(Combined):
    @staticmethod
    def combine_states(a: Tensor, b: Tensor) -> Tensor:
        return torch.maximum(a, b)  # full if any part is, empty only if every part is

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = call_mod(self.mods[0], b, h, q_idx, kv_idx)
        for m in self.mods[1:]:
            out = out | call_mod(m, b, h, q_idx, kv_idx)
        return out


def call_mod(mod: Any, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Call one combined mask_mod, checking its dtype but keeping its shape (so combinations
    also work under FlexAttention's vmap, where the indices are scalars)."""
    out = mod(b, h, q_idx, kv_idx)
    if isinstance(out, bool):
        return torch.tensor(out, device=q_idx.device)
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        shape = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        check_mask_result(out, mod, shape)  # raises with the mask_mod's name
    return out


# -------------------------------------------------------------------------------------- scores


class BuiltinScore(Value):
    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        raise NotImplementedError

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        """Raise ValueError if this score_mod cannot describe a ``[B, H, Lq, Lk]`` problem."""

    def carried(self) -> list[tuple[str, object]]:
        """The tensors this score holds, as ``(what, tensor)`` (``qkv.distributed`` compares
        them across ranks)."""
        return []

    def _heads(self, what: str, n: int, H: int) -> None:
        if n != H:
            raise ValueError(
                f"{self!r}: {what} has {n} entries but q has {H} heads; give one per query head"
            )


class Alibi(BuiltinScore):
    def __init__(self, slopes: Tensor) -> None:
        self.slopes = slopes

    def params(self) -> tuple[object, ...]:
        return (self.slopes,)

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        slopes = self.slopes.to(device=score.device)
        return score + slopes[h] * (kv_idx - q_idx)

    def carried(self) -> list[tuple[str, object]]:
        return [("slopes", self.slopes)]

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        self._heads("slopes", self.slopes.shape[0], H)

    def __repr__(self) -> str:
        return f"qkv.alibi(<{self.slopes.shape[0]} slopes>)"


class Softcap(BuiltinScore):
    plain = True

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def params(self) -> tuple[object, ...]:
        return (self.cap,)

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return self.cap * torch.tanh(score / self.cap)

    def __repr__(self) -> str:
        return f"qkv.softcap({self.cap})"


class RelativeBias(BuiltinScore):
    def __init__(self, table: Tensor, max_distance: int) -> None:
        self.table, self.max_distance = table, max_distance

    def params(self) -> tuple[object, ...]:
        return (self.table, self.max_distance)

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        r = self.max_distance
        rel = (q_idx - kv_idx).clamp(-r, r) + r  # index into the table's first axis
        table = self.table.to(device=score.device)
        return score + table[rel, h]

    def carried(self) -> list[tuple[str, object]]:
        return [("table", self.table)]

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        self._heads("table's second axis", self.table.shape[1], H)

    def __repr__(self) -> str:
        return f"qkv.relative_bias(<table {list(self.table.shape)}>, {self.max_distance})"

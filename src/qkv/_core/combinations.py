"""Combinations of masks: ``qkv.and_masks`` and ``qkv.or_masks`` make them. Like every
built-in mask (:mod:`qkv._core.builtin_mods`) they carry their own rules: the formula, the
value (equal when their parts are), the tile rule (their parts' rules combined), the terms
(an ``and`` meets its parts' terms; an ``or`` is rest unless the door simplified it into a
band or a prefix) and the spec (their parts' specs).
"""

from __future__ import annotations

from typing import Any

import torch

from .builtin_mods import BuiltinMask
from .checks import check_mask_result
from .grid import Grid
from .spec import from_spec, registered, split
from .terms import Terms, meet_all

Tensor = torch.Tensor


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

    word = ""  # its spec's name: "and" or "or"

    def spec(self, tensors: list[Tensor]) -> str | None:
        parts = [m.spec(tensors) if isinstance(m, BuiltinMask) else None for m in self.mods]
        if any(s is None for s in parts):
            return None  # a user's mask_mod among the parts
        return f"{self.word}({';'.join(parts)})"  # type: ignore[arg-type]

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> Combined:
        mods = tuple(from_spec(a, tensors) for a in split(args))
        return cls(mods, f"{cls.word}({args})")

    def _check_problem(self, B: int, H: int, Lq: int, Lk: int) -> None:
        for m in self.mods:
            check = getattr(m, "_check_problem", None)
            if check is not None:
                check(B, H, Lq, Lk)

    def __repr__(self) -> str:
        return self._name


@registered("and")
class And(Combined):
    word = "and"

    def terms(self) -> Terms:
        """Its parts' terms met (bands intersect); a part whose term is already taken (a
        second key range or id tensor) stays rest."""
        return meet_all(
            [(m.terms() if isinstance(m, BuiltinMask) else Terms(rest=(m,)), m) for m in self.mods]
        )

    @staticmethod
    def combine_states(a: Tensor, b: Tensor) -> Tensor:
        return torch.minimum(a, b)  # empty if any part is empty, full only if every part is

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = call_mod(self.mods[0], b, h, q_idx, kv_idx)
        for m in self.mods[1:]:
            out = out & call_mod(m, b, h, q_idx, kv_idx)
        return out


@registered("or")
class Or(Combined):
    word = "or"

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

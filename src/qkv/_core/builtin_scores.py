"""The built-in scores' classes: :mod:`qkv.scores` makes them (``qkv.alibi(slopes)``,
``qkv.softcap(30.0)``, ``qkv.relative_bias(table, 128)``). Like the masks'
(:mod:`qkv._core.builtin_mods`), each carries its own rules: its formula
(``score_mod(score, b, h, q_idx, kv_idx)``), its value (equal and hashed by its parameters),
its spec for a custom operator (:mod:`qkv._core.spec`), its terms (:class:`ScoreTerms`: the
formula a fused kernel implements, with its tensor), what ``qkv.distributed`` compares across
ranks, and its check against a problem's sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import number, read, registered, slot
from .value import Value

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class ScoreTerms:
    """A built-in score as the formula a fused kernel implements (one field set):

    - ``slopes [H]``: ``score + slopes[h] * (kv_idx - q_idx)`` (ALiBi);
    - ``cap``: ``cap * tanh(score / cap)`` (softcap);
    - ``table [2R+1, H]`` with ``max_distance`` R: ``score + table[clamp(q_idx - kv_idx, -R,
      R) + R, h]`` (relative bias).
    """

    slopes: Tensor | None = None
    cap: float | None = None
    table: Tensor | None = None
    max_distance: int = 0

    @property
    def tensor(self) -> Tensor | None:
        """The one tensor the formula reads (``None`` for softcap)."""
        return self.slopes if self.slopes is not None else self.table


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

    def spec(self, tensors: list[Tensor]) -> str:
        """Its spec (:mod:`qkv._core.spec`), its tensors appended to ``tensors``."""
        raise NotImplementedError

    def terms(self) -> ScoreTerms | None:
        """Its formula as fused kernels know it (:class:`ScoreTerms`); ``None`` when no
        kernel implements it (it is then evaluated as code)."""
        return None

    def _heads(self, what: str, n: int, H: int) -> None:
        if n != H:
            raise ValueError(
                f"{self!r}: {what} has {n} entries but q has {H} heads; give one per query head"
            )


@registered("alibi")
class Alibi(BuiltinScore):
    def __init__(self, slopes: Tensor) -> None:
        self.slopes = slopes

    def spec(self, tensors: list[Tensor]) -> str:
        return f"alibi({slot(self.slopes, tensors)})"

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> Alibi:
        return Alibi(read(args, tensors))

    def terms(self) -> ScoreTerms:
        return ScoreTerms(slopes=self.slopes)

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


@registered("softcap")
class Softcap(BuiltinScore):
    plain = True

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def spec(self, tensors: list[Tensor]) -> str:
        return f"softcap({number(self.cap, tensors)})"

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> Softcap:
        return Softcap(float(read(args, tensors)))

    def terms(self) -> ScoreTerms:
        return ScoreTerms(cap=self.cap)

    def params(self) -> tuple[object, ...]:
        return (self.cap,)

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return self.cap * torch.tanh(score / self.cap)

    def __repr__(self) -> str:
        return f"qkv.softcap({self.cap})"


@registered("relative")
class RelativeBias(BuiltinScore):
    def __init__(self, table: Tensor, max_distance: int) -> None:
        self.table, self.max_distance = table, max_distance

    def spec(self, tensors: list[Tensor]) -> str:
        return f"relative({slot(self.table, tensors)},{number(self.max_distance, tensors)})"

    @classmethod
    def from_spec(cls, args: str, tensors: list[Tensor]) -> RelativeBias:
        t, r = args.split(",")
        return RelativeBias(read(t, tensors), read(r, tensors))

    def terms(self) -> ScoreTerms:
        return ScoreTerms(table=self.table, max_distance=self.max_distance)

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


@registered("bias")
class BiasSpec:
    """Reads an additive bias's spec back (a bias is a tensor, not a class of its own)."""

    @staticmethod
    def from_spec(args: str, tensors: list[Tensor]) -> Tensor:
        return read(args, tensors)

"""Which rows of a sequence each rank holds: the ``contiguous`` and ``zigzag`` layouts.

A sequence of ``L`` positions is cut into ``n`` chunks of ``c = ceil(L / n)`` positions (the
last ones shorter, possibly empty when ``L < n``): ``n = W`` for ``contiguous`` (rank ``r``
holds chunk ``r``) and ``n = 2W`` for ``zigzag`` (rank ``r`` holds chunks ``r`` and
``2W - 1 - r``, in that order, so that under a causal mask every rank gets one cheap and one
expensive chunk; Striped/zigzag ring attention, Brandon et al. 2023, Liu et al.'s ring
attention follow-ups). For ``L = 10, W = 2``::

    contiguous  c = 5   rank 0: 0 1 2 3 4        rank 1: 5 6 7 8 9
    zigzag      c = 3   rank 0: 0 1 2 | 9        rank 1: 3 4 5 | 6 7 8

Chunks of one size ``c`` are exactly the blocks of a ``c x c`` tiling of the score matrix,
so qkv's block classification (:mod:`qkv._core.tiles`) says at once which chunk pairs a mask
leaves empty, partial or full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor

LAYOUTS = ("zigzag", "contiguous")
"""The layouts ``layout=`` takes: ``"zigzag"`` (rank ``r`` holds chunks ``r`` and ``2W-1-r`` of
``2W``, which balances causal work) and ``"contiguous"`` (chunk ``r`` of ``W``)."""


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return str(layout)


@dataclass(frozen=True)
class Layout:
    """The split of ``L`` positions over ``world_size`` ranks.

    ``chunks(r)`` are rank ``r``'s chunk ids, ``bounds(i)`` chunk ``i``'s ``[start, stop)``,
    ``positions(r)`` the global positions of rank ``r``'s rows (in its local order) and
    ``lengths`` every rank's row count. ``take(x, r)`` cuts rank ``r``'s rows out of a full
    ``[B, H, L, D]`` tensor (``[B, H, L_local, D]``); ``assemble`` puts them back.
    """

    kind: str
    world_size: int
    L: int

    @property
    def zigzag(self) -> bool:
        """Each rank holds two chunks, one from each end (load-balanced causal)."""
        return self.kind == "zigzag"  # the layout's name, as the user gave it

    def __post_init__(self) -> None:
        check_layout(self.kind)
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"world_size must be an int, got {type(self.world_size).__name__}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if isinstance(self.L, bool) or not isinstance(self.L, int) or self.L < 1:
            raise ValueError(f"the sequence length L must be an int >= 1, got {self.L!r}")

    @property
    def n_chunks(self) -> int:
        return 2 * self.world_size if self.zigzag else self.world_size

    @property
    def chunk(self) -> int:
        """``c``: every chunk's length but the last non-empty one's."""
        return -(-self.L // self.n_chunks)

    def bounds(self, i: int) -> tuple[int, int]:
        c = self.chunk
        return min(i * c, self.L), min((i + 1) * c, self.L)

    def chunk_len(self, i: int) -> int:
        a, b = self.bounds(i)
        return b - a

    def chunks(self, rank: int) -> tuple[int, ...]:
        if self.zigzag:
            return (rank, self.n_chunks - 1 - rank)
        return (rank,)

    def owner(self, chunk: int) -> int:
        return chunk if chunk < self.world_size else self.n_chunks - 1 - chunk

    def local_start(self, rank: int, chunk: int) -> int:
        """Where ``chunk``'s rows start among rank's local rows."""
        at = 0
        for i in self.chunks(rank):
            if i == chunk:
                return at
            at += self.chunk_len(i)
        raise ValueError(f"chunk {chunk} is not held by rank {rank}")

    def length(self, rank: int) -> int:
        return sum(self.chunk_len(i) for i in self.chunks(rank))

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.length(r) for r in range(self.world_size))

    def positions(self, rank: int) -> Tensor:
        """int64 ``[L_local]``: the global position of each of rank's local rows."""
        parts = [torch.arange(*self.bounds(i), dtype=torch.int64) for i in self.chunks(rank)]
        return torch.cat(parts)

    def take(self, x: Tensor, rank: int, dim: int = 2) -> Tensor:
        """Rank's rows of a full tensor ``x`` (positions along ``dim``), as views when they
        are one run; differentiable."""
        d = dim % x.ndim
        if x.shape[d] != self.L:
            raise ValueError(
                f"a tensor of shape {tuple(x.shape)} has {x.shape[d]} positions along dim "
                f"{dim}, but this layout splits L = {self.L}"
            )
        pieces = [x.narrow(d, a, b - a) for a, b in map(self.bounds, self.chunks(rank))]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)

    def assemble(self, shards: list[Tensor], dim: int = 2) -> Tensor:
        """The full tensor from every rank's local rows (``shards[r]``, in rank order)."""
        by_chunk: dict[int, Tensor] = {}
        for r, t in enumerate(shards):
            d = dim % t.ndim
            for i in self.chunks(r):
                by_chunk[i] = t.narrow(d, self.local_start(r, i), self.chunk_len(i))
        d = dim % shards[0].ndim
        return torch.cat([by_chunk[i] for i in range(self.n_chunks)], dim=d)

    def __str__(self) -> str:
        rows = ", ".join(
            f"rank {r}: " + " + ".join("[{}, {})".format(*self.bounds(i)) for i in self.chunks(r))
            for r in range(self.world_size)
        )
        return f"{self.kind} layout of L = {self.L} over {self.world_size} ranks: {rows}"


def infer_length(kind: str, world_size: int, lengths: list[int]) -> int | None:
    """The ``L`` whose layout gives exactly these per-rank ``lengths``, or None."""
    total = sum(lengths)
    if total < 1:
        return None
    lay = Layout(kind, world_size, total)
    return total if list(lay.lengths) == list(lengths) else None

"""Rotary position embeddings (RoPE; Su et al., 2021, "RoFormer"), rotate-half form.

The rotate-half formulation is the one GPT-NeoX and Llama checkpoints were trained with: the
head dim is split into two halves ``x = [x1, x2]`` and feature ``i`` of the first half is
rotated together with feature ``i`` of the second half by the angle ``pos * base^(-2i/dim)``::

    rope(x, pos) = x * cos(pos * θ) + rotate_half(x) * sin(pos * θ),
    rotate_half([x1, x2]) = [-x2, x1],   θ = base^(-[0, 2, 4, ..., dim-2] / dim) repeated twice

Because a rotation by ``a`` followed by the inverse rotation by ``b`` is a rotation by
``a - b``, ``rope(q, m) · rope(k, n)`` depends on the positions only through ``m - n``.
"""

from __future__ import annotations

import torch
from torch import nn

Tensor = torch.Tensor

__all__ = ["RotaryEmbedding"]


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [..., dim/2] each
    return torch.cat((-x2, x1), dim=-1)  # [..., dim]


class RotaryEmbedding(nn.Module):
    """Rotary position embeddings, applied to queries and keys at absolute positions.

    Args:
        dim: how many features of each head to rotate (even). Usually the head dim; a smaller
            value rotates only the first ``dim`` features (GPT-NeoX's ``rotary_pct < 1``).
        base: the wavelength base ``θ_i = base^(-2i/dim)`` (10000 in RoFormer, GPT-NeoX,
            Llama 1/2; 500000 in Llama 3).

    The cos/sin tables are computed in float64 and cast to the input's dtype, so positions in
    the tens of thousands keep full float32 accuracy. They are cached per (device, dtype) and
    grown on demand, never recomputed per decoding step; they are not part of the
    ``state_dict`` (checkpoints do not carry them).

    Example::

        >>> import torch, qkv
        >>> rope = qkv.RotaryEmbedding(64)
        >>> q = torch.randn(2, 8, 16, 64)            # [B, H, L, D]
        >>> rope(q, offset=100).shape                # positions 100..115
        torch.Size([2, 8, 16, 64])
    """

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"RotaryEmbedding dim must be a positive int, got {dim!r}")
        if dim % 2:
            raise ValueError(
                f"RotaryEmbedding dim must be even (features are rotated in pairs), got {dim}; "
                f"use a head dim such as {dim - 1} or {dim + 1}"
            )
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
            raise ValueError(f"RotaryEmbedding base must be a number > 1, got {base!r}")
        self.dim = dim
        self.base = float(base)
        # (device, dtype) -> (cos, sin), each [n, dim]; grown to the largest position seen.
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}"

    def _table(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin ``[>= n, dim]`` for positions ``0..n-1`` (and maybe more)."""
        key = (device, dtype)
        cached = self._tables.get(key)
        if cached is not None and cached[0].shape[0] >= n:
            return cached
        # Grow geometrically so a decode loop recomputes the table O(log n) times.
        size = max(n, 2 * cached[0].shape[0] if cached is not None else 256)
        inv_freq = self.base ** (
            -torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim
        )  # [dim/2]
        pos = torch.arange(size, dtype=torch.float64, device=device)  # [n]
        angles = torch.outer(pos, inv_freq)  # [n, dim/2]
        angles = torch.cat((angles, angles), dim=-1)  # [n, dim]
        table = (angles.cos().to(dtype), angles.sin().to(dtype))
        self._tables[key] = table
        return table

    def cos_sin(
        self, positions: Tensor | int, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """``cos, sin [L, dim]`` for ``length`` positions starting at an int ``positions``, or
        ``[..., L, dim]`` for an integer tensor ``positions [..., L]``."""
        if isinstance(positions, int):
            cos, sin = self._table(positions + length, device, dtype)
            return cos[positions : positions + length], sin[positions : positions + length]
        n = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self._table(n, device, dtype)
        return cos[positions], sin[positions]

    def forward(self, x: Tensor, *, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Rotate ``x [..., L, D]`` (``D >= dim``) at positions ``offset..offset+L-1``.

        ``positions`` (an integer tensor ``[L]`` or broadcastable ``[..., L]``) overrides
        ``offset``. Only the first ``dim`` features are rotated; the rest pass through.
        Returns a tensor of ``x``'s shape and dtype.
        """
        width = x.shape[-1]
        if width < self.dim:
            raise ValueError(
                f"RotaryEmbedding rotates {self.dim} features but x has only {width} per head; "
                f"use RotaryEmbedding({width}) or smaller"
            )
        L = x.shape[-2]
        if positions is not None:
            if positions.dtype.is_floating_point or positions.shape[-1] != L:
                raise ValueError(
                    f"positions must be an integer tensor [..., L] with L = {L}, got shape "
                    f"{tuple(positions.shape)} and dtype {positions.dtype}"
                )
            cos, sin = self.cos_sin(positions.to(x.device), L, x.device, x.dtype)
        else:
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"offset must be an int >= 0, got {offset!r}")
            cos, sin = self.cos_sin(offset, L, x.device, x.dtype)
        if width == self.dim:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)

"""qkv.RotaryEmbedding: a float64 complex-rotation implementation and the relative property."""

from __future__ import annotations

import pytest
import torch

import qkv
from mha_testing import plain_rope

Tensor = torch.Tensor


def _err(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("dim", [2, 64, 110])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_matches_float64_complex_rotation(dim, base):
    torch.manual_seed(0)
    rope = qkv.RotaryEmbedding(dim, base=base)
    x = torch.randn(2, 3, 37, dim, dtype=torch.float64)  # [B, H, L, D]
    for offset in (0, 1, 4000):
        pos = torch.arange(offset, offset + 37)
        assert _err(rope(x, offset=offset), plain_rope(x, pos, dim, base)) < 1e-12


def test_float32_error_within_plain_float32():
    """Tables built in float64: at large positions the float32 result is at least as close to
    the float64 truth as a plain float32 computation of the angles."""
    torch.manual_seed(0)
    rope = qkv.RotaryEmbedding(64)
    x = torch.randn(1, 2, 16, 64)
    pos = torch.arange(30000, 30016)
    truth = plain_rope(x.double(), pos, 64, 10000.0)
    ours, plain32 = rope(x, offset=30000), plain_rope(x, pos, 64, 10000.0)
    assert ours.dtype == torch.float32
    assert _err(ours, truth) <= 2 * _err(plain32, truth) + 1e-6
    assert _err(ours, truth) < 1e-5


def test_relative_position_property():
    """rope(q, m) · rope(k, n) depends on the positions only through m - n."""
    torch.manual_seed(0)
    rope = qkv.RotaryEmbedding(32)
    q, k = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)

    def dot(m: int, n: int) -> float:
        qm = rope(q[None, :], positions=torch.tensor([m]))[0]
        kn = rope(k[None, :], positions=torch.tensor([n]))[0]
        return float(qm @ kn)

    for m, n in [(5, 2), (0, 7), (100, 100)]:
        for shift in (1, 13, 2048):
            assert abs(dot(m, n) - dot(m + shift, n + shift)) < 1e-10
    assert abs(dot(5, 2) - dot(5, 3)) > 1e-3  # and it does depend on the offset
    assert abs(dot(3, 3) - float(q @ k)) < 1e-12  # offset 0 leaves the dot product alone


def test_positions_tensor_and_offset_agree_and_norm_is_kept():
    rope = qkv.RotaryEmbedding(16)
    x = torch.randn(2, 4, 9, 16, dtype=torch.float64)
    assert torch.equal(rope(x, offset=5), rope(x, positions=torch.arange(5, 14)))
    assert _err(rope(x, offset=5).norm(dim=-1), x.norm(dim=-1)) < 1e-12


def test_partial_rotary_leaves_the_rest():
    rope = qkv.RotaryEmbedding(8)
    x = torch.randn(1, 2, 5, 12, dtype=torch.float64)
    y = rope(x, offset=3)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert _err(y, plain_rope(x, torch.arange(3, 8), 8, 10000.0)) < 1e-12


def test_tables_are_not_state():
    rope = qkv.RotaryEmbedding(8)
    rope(torch.randn(1, 1, 300, 8))
    assert rope.state_dict() == {}
    assert "dim=8" in repr(rope)


def test_errors():
    with pytest.raises(ValueError, match=r"even.*got 7"):
        qkv.RotaryEmbedding(7)
    with pytest.raises(ValueError, match="base"):
        qkv.RotaryEmbedding(8, base=1.0)
    with pytest.raises(ValueError, match="rotates 8 features but x has only 6"):
        qkv.RotaryEmbedding(8)(torch.randn(2, 6))
    with pytest.raises(ValueError, match="offset"):
        qkv.RotaryEmbedding(8)(torch.randn(2, 8), offset=-1)
    with pytest.raises(ValueError, match="L = 2"):
        qkv.RotaryEmbedding(8)(torch.randn(2, 8), positions=torch.arange(3))

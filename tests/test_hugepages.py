"""Huge pages requested for large fresh CPU outputs: a hint only, the tensor is the same."""

from __future__ import annotations

import pytest
import torch

from qkv import _hugepages


@pytest.mark.parametrize("numel", [0, 1000, (32 << 20) // 4 + 12345])
def test_empty_is_a_plain_writable_tensor(numel):
    like = torch.zeros(2, dtype=torch.float32)
    t = _hugepages.empty((numel,), like)
    assert t.shape == (numel,) and t.dtype == like.dtype and t.device == like.device
    t.fill_(3.0)
    assert bool((t == 3.0).all())


def test_a_refused_hint_turns_itself_off(monkeypatch):
    calls = []

    def refuse(addr, length, advice):
        calls.append((addr, length, advice))
        assert addr % _hugepages._HUGE == 0 and length % _hugepages._HUGE == 0
        return -1

    monkeypatch.setitem(_hugepages._state, "fn", refuse)
    like = torch.zeros(1)
    t = _hugepages.empty((3 * (_hugepages._MIN_BYTES // 4),), like)
    assert len(calls) == 1 and _hugepages._state["fn"] is None
    u = _hugepages.empty((3 * (_hugepages._MIN_BYTES // 4),), like)  # not asked again
    assert len(calls) == 1 and t.shape == u.shape


def test_small_and_non_cpu_tensors_are_not_advised(monkeypatch):
    monkeypatch.setitem(_hugepages._state, "fn", lambda *a: pytest.fail("advised"))
    _hugepages.empty((1000,), torch.zeros(1))
    _hugepages.empty((_hugepages._MIN_BYTES // 4,), torch.zeros(1, device="meta"))

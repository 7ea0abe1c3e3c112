"""Backends: each computes the same contract (see :mod:`qkv.reference`) a different way.

The protocol is :class:`qkv.backends.base.Backend`; this registry is the one place that
lists them. ``backend="auto"`` tries them in ``AUTO_ORDER`` (see :mod:`qkv.planner`).
"""

from __future__ import annotations

from .base import Backend
from .blocksparse import BlocksparseBackend
from .decode import DecodeBackend
from .reference import ReferenceBackend
from .sdpa import SdpaBackend
from .triton import TritonBackend

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        DecodeBackend(),
        SdpaBackend(),
        TritonBackend(),
        BlocksparseBackend(),
        ReferenceBackend(),
    )
}
# The auto policy is the backends' own (Backend.auto_skip, Backend.claims; qkv.planner applies
# it). sdpa first where the problem maps onto torch's kernel directly (no mask, causal, a bias),
# except where a later backend claims it (decode, blocksparse's band kernel); decode for a few
# query rows per kv head with nothing to learn (a decode step on the CPU, masks of one key run
# per row included); triton for masks on CUDA (the fused kernel over the tile plan);
# blocksparse for everything else (masks on the CPU, score_mods, lse); the reference as the
# last resort.
AUTO_ORDER: list[str] = ["sdpa", "decode", "triton", "blocksparse", "reference"]

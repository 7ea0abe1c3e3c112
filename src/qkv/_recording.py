"""The switch :func:`qkv.attention` reads to hand each call to an active recorder.

Kept tiny and free of heavy imports because ``qkv.attention`` reads :data:`ACTIVE` on every
call: one ``ContextVar.get()`` (tens of nanoseconds) when nothing records. The recorder itself
lives in :mod:`qkv.inspect`.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol

import torch


class Observer(Protocol):
    def observe(self, problem: Any, lse: torch.Tensor) -> None:
        """Called by ``qkv.attention`` with the normalised problem and its ``lse [B, Hq, Lq]``."""


# The recorder that wants every qkv.attention call, or None (the default: nothing records).
ACTIVE: ContextVar[Observer | None] = ContextVar("qkv_recorder", default=None)
# The name of the innermost recorded attention module whose forward is running.
LAYER: ContextVar[str] = ContextVar("qkv_layer", default="")

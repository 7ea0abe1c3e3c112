"""The switch :func:`qkv.attention` reads to hand each call to an active recorder.

Kept tiny and free of heavy imports because ``qkv.attention`` calls :func:`current` on every
call. With nothing recording that is one function call and one global read (timeit: ~60 ns,
against ~73 µs for the smallest attention call). The recorder itself lives in
:mod:`qkv.inspect`.

``torch.compile`` cannot trace ``ContextVar.get`` (dynamo raises Unsupported), so the
ContextVar is only read while some recording is open and never while compiling: compiled code
sees a plain global int (dynamo guards on it) and is not recorded.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from typing import Any, Protocol

import torch


class Observer(Protocol):
    def observe(self, problem: Any, lse: torch.Tensor) -> None:
        """Called by ``qkv.attention`` with the normalised problem and its ``lse [B, Hq, Lq]``."""


class AttentionLayer:
    """Base of the modules that name a layer in a recording (``qkv.MultiHeadAttention``).

    ``qkv.inspect.record`` hooks the submodules that are instances of it. It lives here, below
    both, so that ``qkv.inspect`` finds them without importing the module layer, which imports
    ``qkv.inspect`` (for ``need_weights=True``).
    """


# The recorder that wants every qkv.attention call in this context, or None.
ACTIVE: ContextVar[Observer | None] = ContextVar("qkv_recorder", default=None)
# The name of the innermost recorded attention module whose forward is running.
LAYER: ContextVar[str] = ContextVar("qkv_layer", default="")
# The module a call is made for when that module is not a qkv one (qkv.hf's attention function
# sets it to the transformers attention module): the recorder names the call by that module's
# dotted name inside the recorded model.
CALLER: ContextVar[object | None] = ContextVar("qkv_caller", default=None)

# record() blocks open in any thread; while 0, current() reads nothing else (and qkv.attention
# does not call it: a repeat call stays in its own few files)
OPEN = 0
_lock = threading.Lock()


def current() -> Observer | None:
    """The active recorder of this context, or ``None`` (always ``None`` while compiling)."""
    if not OPEN or torch.compiler.is_compiling():
        return None
    return ACTIVE.get()


def opened(delta: int) -> None:
    """Count a record() block in (+1) or out (-1)."""
    global OPEN
    with _lock:
        OPEN += delta

"""``qkv.override_sdpa()``: run an unedited PyTorch model's SDPA calls on qkv.

While an override is open, ``torch.nn.functional.scaled_dot_product_attention`` is a small
dispatcher: in a thread that opened an override it calls
:func:`qkv.scaled_dot_product_attention`, in any other thread torch's own function. It is
installed when the first override opens (in any thread) and torch's function is put back when
the last one closes.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar, overload

import torch
import torch.nn.functional as F
from torch import nn

from . import _recording
from .torch_sdpa import scaled_dot_product_attention

Tensor = torch.Tensor
_Fn = TypeVar("_Fn", bound=Callable[..., Any])

__all__ = ["override_sdpa"]

# What F.scaled_dot_product_attention was when the first override opened (torch's function,
# or another library's patch of it): calls outside an override go there, and it is put back.
_ORIGINAL: Callable[..., Tensor] = F.scaled_dot_product_attention


# Overrides open in this thread. A threading.local because torch.compile reads it while tracing
# (and guards on it); it cannot trace a ContextVar (dynamo: "Unsupported method call").
class _Thread(threading.local):
    def __init__(self) -> None:  # runs once in each thread that reads it
        self.depth = 0  # overrides open in this thread
        self.busy = False  # qkv is computing a call: its own SDPA calls go to torch


_here = _Thread()
_lock = threading.Lock()
_open = 0  # overrides open in all threads together
_fastpath_before: bool | None = None
# How far up the stack a recorded call looks for the nn.Module that made it (torch's MHA:
# MultiheadAttention.forward -> F.multi_head_attention_forward -> here, 2 frames).
_FRAMES = 12


def _dispatch(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` while some override is open."""
    # Torch's function outside an override, and inside qkv's own computation: qkv's "sdpa"
    # backend calls F.scaled_dot_product_attention too, which must not come back here.
    if _here.depth <= 0 or _here.busy:
        return _ORIGINAL(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    caller = None
    if _recording.current() is not None:
        # Recording (eager only): name the call by the module that made it, as qkv.hf does.
        caller = _calling_module(sys._getframe(1))
    token = _recording.CALLER.set(caller) if caller is not None else None
    _here.busy = True
    try:
        return scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )
    finally:
        _here.busy = False
        if token is not None:
            _recording.CALLER.reset(token)


def _calling_module(frame: FrameType | None) -> nn.Module | None:
    """The innermost ``nn.Module`` whose method is on the stack above ``frame``."""
    for _ in range(_FRAMES):
        if frame is None:
            return None
        me = frame.f_locals.get("self")
        if isinstance(me, nn.Module):
            return me
        frame = frame.f_back
    return None


def _enter() -> None:
    global _open, _fastpath_before, _ORIGINAL
    _here.depth += 1
    with _lock:
        _open += 1
        if _open == 1:
            # nn.MultiheadAttention's and nn.TransformerEncoderLayer's inference fast paths
            # call fused C++ kernels that never reach the Python function: off while an override
            # is open, so those layers take their Python path (the same numbers).
            _fastpath_before = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            if F.scaled_dot_product_attention is not _dispatch:
                _ORIGINAL = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _dispatch


def _exit() -> None:
    global _open
    _here.depth -= 1
    with _lock:
        _open -= 1
        if _open == 0:
            # Put the function back unless someone patched it over ours meanwhile.
            if F.scaled_dot_product_attention is _dispatch:
                F.scaled_dot_product_attention = _ORIGINAL
            if _fastpath_before is not None:
                torch.backends.mha.set_fastpath_enabled(_fastpath_before)


class _Override(contextlib.ContextDecorator):
    """The object :func:`override_sdpa` returns: a context manager and a decorator. It keeps no
    state of its own (the counts are per thread and global), so one instance may be entered
    again, recursively and from several threads."""

    def __enter__(self) -> _Override:
        _enter()
        return self

    def __exit__(self, *exc: object) -> None:
        _exit()


@overload
def override_sdpa(fn: None = None) -> _Override: ...
@overload
def override_sdpa(fn: _Fn) -> _Fn: ...
def override_sdpa(fn: Callable[..., Any] | None = None) -> Any:
    """Route every ``torch.nn.functional.scaled_dot_product_attention`` call through
    :func:`qkv.scaled_dot_product_attention` while the block (or decorated function) runs.

    Works for code that looks the function up when it calls it (``F.scaled_dot_product_attention``
    or ``torch.nn.functional.scaled_dot_product_attention``): ``nn.MultiheadAttention``,
    ``nn.TransformerEncoderLayer`` / ``DecoderLayer``, transformers' ``sdpa`` attention,
    nanoGPT, timm and diffusers blocks: each call's ``query [..., Hq, Lq, D]``, ``key
    [..., Hkv, Lk, D]`` and ``value [..., Hkv, Lk, Dv]`` give ``[..., Hq, Lq, Dv]`` as with
    torch's function. A module that bound the name earlier
    (``from torch.nn.functional import scaled_dot_product_attention`` at import) keeps torch's.

    - Restores torch's function when the last open override closes, also on an exception.
    - Nests: an inner override inside an outer one changes nothing and leaves it open.
    - Thread-aware: calls in threads that did not open an override keep torch's function.
    - ``torch.compile``: a function compiled inside the block traces qkv's function (the
      dispatcher reads a thread-local count, which dynamo guards on: the same compiled
      function called outside the block recompiles back to torch's).
    - :func:`qkv.inspect.record` sees the calls, named by the ``nn.Module`` that made them.
    - While any override is open, torch's inference fast paths of ``nn.MultiheadAttention``
      and ``nn.TransformerEncoderLayer`` are off (``torch.backends.mha``): they call fused C++
      kernels that never reach the Python function. Their Python path gives the same numbers.

    Use as ``with qkv.override_sdpa(): ...``, ``@qkv.override_sdpa()`` or ``@qkv.override_sdpa``.

    Example::

        >>> import torch, qkv
        >>> layer = torch.nn.TransformerEncoderLayer(32, 4, batch_first=True).eval()
        >>> x = torch.randn(2, 10, 32)
        >>> with qkv.override_sdpa(), qkv.inspect.record(layer) as rec:
        ...     y = layer(x)
        >>> rec.layers, torch.allclose(y, layer(x), atol=1e-5)
        (['self_attn'], True)
    """
    if fn is None:
        return _Override()
    if not callable(fn):
        raise TypeError(
            f"override_sdpa takes a function to decorate or nothing, got {type(fn).__name__}; "
            f"use `with qkv.override_sdpa():`"
        )
    return functools.wraps(fn)(_Override()(fn))

"""What qkv tells dynamo (``torch.compile``) without importing it.

``import qkv`` must not import ``torch._dynamo``: it costs about a second, and importing it
before Triton's kernels are defined breaks Triton's interpreter. Its decorators that qkv needs
at module level are applied here by what they do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def assume_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: while dynamo traces, a call of ``fn`` is
    run eagerly and its result taken as a constant (no guard on it). That decorator only sets
    this attribute (``tests/test_compile.py`` checks that it still does)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def is_symbolic(x: object) -> bool:
    """Whether ``x``, an int or float, is symbolic while dynamo traces: ``dynamic=True`` makes
    the ints and floats qkv reads from a call's arguments (a window's edges, a default scale
    of ``1/sqrt(D)``) ``SymInt`` / ``SymFloat``. Dynamo answers ``isinstance`` for them as for
    ``int`` and ``float``, and cannot write them as text, but ``x == x`` is a symbolic bool
    there, not the object ``True`` (``tests/test_compile.py`` checks that it still is). False
    outside a trace."""
    return (x == x) is not True

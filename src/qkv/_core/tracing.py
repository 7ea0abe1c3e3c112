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

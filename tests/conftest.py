"""Fixtures shared by the tests. The oracle comparison lives in ``qkv_testing.py``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch

# Re-exported so tests can `from conftest import ...` or `from qkv_testing import ...`.
from qkv_testing import (  # noqa: F401
    FLOOR,
    Comparison,
    assert_matches_oracle,
    compare_to_oracle,
    oracle,
    plain_attention,
)

os.environ.setdefault("MPLCONFIGDIR", tempfile.mkdtemp(prefix="qkv-mpl-"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-inductor-"))
if not torch.cuda.is_available():
    # Without a GPU, backend="triton" runs its kernels in Triton's interpreter, so the oracle
    # matrix covers them on every machine (triton.jit reads this when the kernels are first
    # imported, which no test does before this file runs).
    os.environ.setdefault("TRITON_INTERPRET", "1")

Tensor = torch.Tensor


@pytest.fixture
def check() -> Callable[..., None]:
    """``check(fn, q, k, v, mask=..., score_mod=...)``: assert ``fn`` matches the oracle."""

    def _check(fn: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> None:
        assert_matches_oracle(compare_to_oracle(fn, q, k, v, **kw))

    return _check


@pytest.fixture
def torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn qkv's compiled CPU kernels off for one test (``QKV_NATIVE=0``): the block-sparse
    engine then runs band masks with torch's fused kernel, the path every machine without a
    C++ compiler takes."""
    monkeypatch.setenv("QKV_NATIVE", "0")


def has_cuda() -> bool:
    return torch.cuda.is_available()


_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda(fn: Any) -> Any:
    """A test that needs a CUDA device: part of the CUDA suite (``pytest -m cuda``, what
    ``benchmarks/gpu_check.sh`` runs) and skipped cleanly without one."""
    return pytest.mark.cuda(_no_cuda(fn))


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after a test, its warnings and logs quieted: each
    compiled test traces anew (tests/test_compile.py, tests/test_compile_views.py)."""
    import logging
    import warnings

    import torch._dynamo

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._logging.set_logs(dynamo=logging.ERROR)
        yield
    torch._logging.set_logs()
    torch._dynamo.reset()

"""Fresh large CPU outputs backed by transparent huge pages, where Linux offers them on request.

A freshly allocated tensor of 32 MiB or more is a new anonymous mapping (glibc maps such
requests directly), and writing it the first time costs one page fault per 4 KiB page: 8192
faults, ~7 ms on the 2-core VM of benchmarks/RESULTS.md, for the 32 MiB output of attention
at n=16384 (B=1, H=8, D=64): more than a tenth of the whole call. When the kernel's
transparent-huge-page mode is ``madvise``, asking for huge pages on that mapping (what torch
itself does for every allocation under ``THP_MEM_ALLOC_ENABLE=1``) makes it 16 faults of
2 MiB: measured 7.4 -> 2.6 ms for filling 32 MiB.

Only the 2 MiB-aligned inside of the tensor's own memory is advised, only for tensors of at
least ``_MIN_BYTES`` (always their own mapping), and only on Linux with the ``madvise`` mode;
the advice is a hint that dies with the mapping. Anything unexpected turns it off silently:
the result is the same tensor either way.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch

_HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page size
_MADV_HUGEPAGE = 14
# glibc's largest mmap threshold: requests at least this big are always their own mapping,
# so the advice never touches memory another allocation will reuse.
_MIN_BYTES = 32 << 20

_state: dict[str, Any] = {}


def _madvise() -> Any:
    """libc's ``madvise``, or ``None`` where huge pages on request are not available."""
    if "fn" in _state:
        return _state["fn"]
    fn = None
    try:
        if sys.platform == "linux":
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                mode = f.read()
            # "[always]": every mapping gets them already; "[never]": none can.
            if "[madvise]" in mode:
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
    except (OSError, AttributeError):
        fn = None
    _state["fn"] = fn
    return fn


def empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """``like.new_empty(shape)``, with huge pages requested for a large CPU tensor."""
    t = like.new_empty(shape)
    if t.device.type != "cpu" or t.nbytes < _MIN_BYTES:
        return t
    fn = _madvise()
    if fn is None:
        return t
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    end = (t.data_ptr() + t.nbytes) // _HUGE * _HUGE
    if end > start and fn(start, end - start, _MADV_HUGEPAGE) != 0:
        _state["fn"] = None  # refused (e.g. a seccomp filter): stop asking
    return t

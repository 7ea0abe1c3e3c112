"""CTranslate2's ``model.bin``, read with numpy (no ``ctranslate2`` at run time).

The format, as ``ctranslate2.specs.model_spec.ModelSpec._serialize`` writes it (little endian)::

    uint32 binary version (6)    string spec name ("WhisperSpec")    uint32 spec revision
    uint32 variable count, then per variable:
        string name   uint8 rank   uint32 dims[rank]   uint8 dtype   uint32 byte count   bytes
    uint32 alias count, then per alias: string alias   string name of the variable it shares

where a string is ``uint16 length`` (terminating NUL included), the bytes, and the NUL, and the
dtype is an index into (float32, int8, int16, int32, float16, bfloat16). Fused projections
(``linear_0`` of a self-attention: Q, K and V rows one after the other) are stored as plain
concatenations, and a scalar option (``decoder/num_heads``) is a 0-d variable.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

__all__ = ["read_model_bin"]

_DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
_VERSIONS = (5, 6)  # what CTranslate2 4.x writes; both have this layout


class _Reader:
    def __init__(self, data: bytes, path: Path) -> None:
        self.data, self.path, self.at = data, path, 0

    def _bad(self, what: str) -> ValueError:
        return ValueError(
            f"{self.path} is not a readable CTranslate2 model.bin: {what} at byte {self.at} of "
            f"{len(self.data)}; re-convert the model or reinstall its package"
        )

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise self._bad(f"{n} more bytes expected (the file is truncated)")
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def u(self, fmt: str) -> int:
        return int(struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0])

    def string(self) -> str:
        n = self.u("H")
        raw = self.take(n)
        if n == 0 or raw[-1] != 0:
            raise self._bad("a name without its terminating NUL")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self._bad("a name that is not UTF-8") from None


def read_model_bin(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """``(spec name, {variable name: array})`` of a CTranslate2 ``model.bin``; aliases map to
    the same array. Arrays are read-only views of the file's bytes (bfloat16 variables are
    returned as float32)."""
    data = path.read_bytes()
    r = _Reader(data, path)
    version = r.u("I")
    if version not in _VERSIONS:
        raise ValueError(
            f"{path} has CTranslate2 binary version {version}; qkv reads versions "
            f"{list(_VERSIONS)} (CTranslate2 3.x and 4.x): re-convert it with a recent "
            f"ct2-transformers-converter"
        )
    spec = r.string()
    r.u("I")  # the spec's revision
    out: dict[str, np.ndarray] = {}
    for _ in range(r.u("I")):
        name = r.string()
        shape = tuple(r.u("I") for _ in range(r.u("B")))
        code = r.u("B")
        if code >= len(_DTYPES):
            raise r._bad(f"variable {name!r} has unknown dtype code {code}")
        nbytes = r.u("I")
        start = r.at
        r.take(nbytes)
        dtype = np.dtype("uint16" if _DTYPES[code] == "bfloat16" else _DTYPES[code])
        count = int(np.prod(shape)) if shape else 1
        if count * dtype.itemsize != nbytes:
            raise r._bad(f"variable {name!r} of shape {list(shape)} holds {nbytes} bytes")
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape)
        if _DTYPES[code] == "bfloat16":  # the high half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr
    for _ in range(r.u("I")):
        alias, target = r.string(), r.string()
        if target not in out:
            raise r._bad(f"alias {alias!r} of a variable {target!r} the file does not have")
        out[alias] = out[target]
    return spec, out

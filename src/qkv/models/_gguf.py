"""Reading a GGUF file: its metadata, and its tensors dequantised to float32.

GGUF (llama.cpp's single-file format) is a header, key/value metadata, a table of tensor
infos, then the tensor data, aligned. The layout and type codes come from the ``gguf``
package (``gguf.constants``) and every block format is dequantised by it
(``gguf.quants.dequantize``). The header is parsed here rather than with ``gguf.GGUFReader``:
that reader makes one numpy view per string, and a 49152-token vocabulary plus 48900 merges
took it 2.8-4.7 s (``cProfile``: ``memmap.__getitem__`` and ``__array_finalize__``) of a
3 s load budget (issue 11); this parser reads the same fields in ~0.1 s and
``tests/test_decoder_gguf.py`` checks that it agrees with ``gguf.GGUFReader`` field by field.

The file is memory-mapped: tensors are dequantised straight from the page cache, and only the
float32 results are allocated.
"""

from __future__ import annotations

import mmap
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

Tensor = torch.Tensor

__all__ = ["SUPPORTED_TYPES", "GGUFFile", "GGUFTensorInfo", "read_gguf"]

# Block formats qkv dequantises (issue 11). Others (K-quants, IQ*) are refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# GGUF value type codes (gguf.constants.GGUFValueType) -> struct format of one scalar.
_SCALARS = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}
_NUMPY = {k: np.dtype("<" + f) for k, f in _SCALARS.items()}  # the same, as numpy dtypes
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table."""

    name: str  # llama.cpp's name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # PyTorch order (rows first): GGUF lists dims fastest-first
    type_name: str  # "Q4_1", "F32", ... (gguf.GGMLQuantizationType names)
    type_code: int
    offset: int  # absolute byte offset in the file
    n_bytes: int


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> value) and ``tensors`` (name -> info); tensors
    are read on demand with :meth:`tensor` / :meth:`tensors_f32`."""

    def __init__(
        self, path: Path, metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo], buf: Any
    ) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._buf = buf  # the mmap; numpy views into it keep it alive

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor ``name`` as ``uint8 [rows, bytes per row]`` (a view, no copy)."""
        info = self.tensors[name]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        flat = np.frombuffer(self._buf, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
        return flat.reshape(rows, info.n_bytes // rows)

    def tensor(self, name: str) -> Tensor:
        """Tensor ``name`` dequantised to float32, in PyTorch's shape (rows first)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        _check_type(self.path, info)
        qtype = GGMLQuantizationType(info.type_code)
        data = self.raw(name)
        # F32 is already float32: copied out of the read-only map; the rest dequantised.
        f32 = info.type_name == "F32"
        arr = data.view(np.float32).copy() if f32 else dequantize(data, qtype)
        return torch.from_numpy(arr).view(info.shape)

    def tensors_f32(self, names: list[str]) -> dict[str, Tensor]:
        """Several tensors at once, dequantised on two threads (numpy releases the GIL in its
        array operations; measured 1.07 s -> see benchmarks/RESULTS.md for SmolLM2)."""
        for name in names:
            _check_type(self.path, self.tensors[name])
        with ThreadPoolExecutor(max_workers=max(1, min(4, torch.get_num_threads()))) as pool:
            return dict(zip(names, pool.map(self.tensor, names), strict=True))


def _check_type(path: Path, info: GGUFTensorInfo) -> None:
    if info.type_name not in SUPPORTED_TYPES:
        raise ValueError(
            f"{path.name}: tensor {info.name} is stored as {info.type_name}, which qkv does not "
            f"dequantise; supported types are {', '.join(SUPPORTED_TYPES)} (re-quantise the "
            f"file with llama.cpp's llama-quantize to one of them, e.g. Q8_0)"
        )


class _Cursor:
    """Little-endian reads from a buffer at a moving offset."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        # The hot loop of the header (98k strings for SmolLM2's vocabulary and merges).
        buf, pos, out = self.buf, self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            out.append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("I"), self.scalar("Q")
            if itype == _STRING:
                return self.strings(count)
            if itype in _NUMPY:
                dt = _NUMPY[itype]
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += dt.itemsize * count
                return arr.tolist()
            return [self.value(itype) for _ in range(count)]  # arrays of arrays (rare)
        raise ValueError(f"{self.path.name}: unknown GGUF value type {vtype} at byte {self.pos}")


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header, metadata and tensor table of the GGUF file at ``path``.

    Raises FileNotFoundError for a missing file and ValueError for a file that is not GGUF
    (bad magic) or of an unsupported version.
    """
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {str(path)!r}")
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path.name}: empty file, not a GGUF file") from None
    cur = _Cursor(buf, path)
    if len(buf) < 24 or cur.scalar("I") != GGUF_MAGIC:
        raise ValueError(
            f"{path.name} is not a GGUF file (it does not start with the bytes 'GGUF'); give a "
            f".gguf file written by llama.cpp's converters"
        )
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"{path.name}: GGUF version {version}; qkv reads versions 2 and 3")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("I"))
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("I")
        dims = [cur.scalar("Q") for _ in range(n_dims)]
        raw_infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    align = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    start = -(-cur.pos // align) * align  # the data section begins at the next aligned byte
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, code, rel in raw_infos:
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise ValueError(f"{path.name}: tensor {name} has unknown type code {code}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims)) if dims else 1
        n_bytes = n_elems * type_size // block
        if start + rel + n_bytes > len(buf):
            raise ValueError(f"{path.name} is truncated: tensor {name} runs past the file's end")
        shape = tuple(int(d) for d in reversed(dims))  # GGUF dims are fastest-first
        tensors[name] = GGUFTensorInfo(name, shape, qtype.name, code, start + rel, n_bytes)
    return GGUFFile(path, metadata, tensors, buf)

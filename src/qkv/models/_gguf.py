"""Reading a GGUF file: its metadata, and its tensors dequantised to float32.

GGUF (llama.cpp's single-file format) is a header, key/value metadata, a table of tensor
infos, then the tensor data, aligned. The layout and type codes come from the ``gguf``
package (``gguf.constants``) and every block format is dequantised by it
(``gguf.quants.dequantize``). The header is parsed here rather than with ``gguf.GGUFReader``:
that reader makes one numpy view per string, and a 49152-token vocabulary plus 48900 merges
took it 2.8-4.7 s (``cProfile``: ``memmap.__getitem__`` and ``__array_finalize__``) of a
3 s load budget; this parser reads the same fields in ~0.1 s and
``tests/test_decoder_gguf.py`` checks that it agrees with ``gguf.GGUFReader`` field by field.

The file is memory-mapped: tensors are dequantised straight from the page cache, and only the
float32 results are allocated. Every count, length, dimension and offset the file gives is
checked against the file's size before it is used (as llama.cpp's ``gguf_init_from_file``
does), so a truncated or corrupt file is one ValueError naming it, never ``struct.error`` or
an allocation sized by garbage (``tests/test_model_files.py``).
"""

from __future__ import annotations

import math
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

# Block formats qkv dequantises. Others (K-quants, IQ*) are refused by name.
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
    """Little-endian reads from a buffer at a moving offset, each checked against the end of
    the file: a truncated or corrupt file fails with one ValueError naming the file and the
    field being read (``where``), never with ``struct.error`` or a short read taken as whole."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)
        self.where = "the header"  # what is being read, for the error message

    def corrupt(self, what: str) -> ValueError:
        return ValueError(
            f"{self.path} is truncated or corrupt: {what} (in {self.where}); the file is "
            f"{self.size} bytes. Download or convert it again"
        )

    def need(self, n: int, what: str) -> None:
        """Fail unless ``n`` more bytes are in the file (checked before anything is read or
        allocated from a count that the file itself gave)."""
        if n > self.size - self.pos:
            raise self.corrupt(
                f"{what} needs {n} bytes at byte {self.pos} but the file ends at byte {self.size}"
            )

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, "a value")
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def count(self, fmt: str, min_item_bytes: int, what: str) -> int:
        """A count read from the file, refused when that many items, each at least
        ``min_item_bytes`` long, cannot fit in the bytes that are left."""
        n = int(self.scalar(fmt))
        if n * min_item_bytes > self.size - self.pos:
            raise self.corrupt(
                f"{what} is {n}, which needs at least {n * min_item_bytes} more bytes, but only "
                f"{self.size - self.pos} are left"
            )
        return n

    def string(self) -> str:
        n = self.count("Q", 1, "a string's length")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        # The hot loop of the header (98k strings for SmolLM2's vocabulary and merges): each
        # length is checked against the file's end before its bytes are decoded (a corrupt
        # length would otherwise decode the rest of the file: 1 GB for SmolLM2's), and a
        # length field past the end is the struct.error caught below.
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if n > size - pos:
                    break
                out.append(buf[pos : pos + n].decode("utf-8", errors="replace"))
                pos += n
        except struct.error:
            pass
        if len(out) < count:
            raise self.corrupt(f"string {len(out)} of {count} runs past the end of the file")
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype = self.scalar("I")
            if itype == _STRING:
                return self.strings(self.count("Q", 8, "the array's length"))
            if itype in _NUMPY:
                dt = _NUMPY[itype]
                count = self.count("Q", dt.itemsize, "the array's length")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += dt.itemsize * count
                return arr.tolist()
            if itype != _ARRAY:
                raise self.corrupt(f"unknown GGUF array item type {itype} at byte {self.pos}")
            # arrays of arrays (rare): each at least its item type and its length
            count = self.count("Q", 12, "the array's length")
            return [self.value(itype) for _ in range(count)]
        raise self.corrupt(f"unknown GGUF value type {vtype} at byte {self.pos}")


# llama.cpp's GGML_MAX_DIMS: a tensor has at most 4 dimensions.
_MAX_DIMS = 4
# The fewest bytes a key/value pair (key length, an empty key, value type, a 1-byte value) and
# a tensor info (name length, an empty name, n_dims, type, offset) take: counts are checked
# against them before a loop runs that many times.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header, metadata and tensor table of the GGUF file at ``path``.

    Raises FileNotFoundError for a missing file and ValueError for a file that is not GGUF
    (bad magic), of an unsupported version, or truncated or corrupt (a count, length, offset
    or dimension that disagrees with the file: checked before anything is allocated from it).
    """
    from gguf import GGUF_MAGIC

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {str(path)!r}")
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path}: empty file, not a GGUF file") from None
    cur = _Cursor(buf, path)
    if len(buf) < 4 or cur.scalar("I") != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); give a "
            f".gguf file written by llama.cpp's converters"
        )
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}; qkv reads versions 2 and 3")
    n_tensors = cur.count("Q", _MIN_TENSOR_INFO_BYTES, "the number of tensors")
    n_kv = cur.count("Q", _MIN_KV_BYTES, "the number of metadata keys")
    metadata = _read_metadata(cur, n_kv)
    raw_infos = _read_tensor_infos(cur, n_tensors)
    align = _alignment(metadata, path)
    start = -(-cur.pos // align) * align  # the data section begins at the next aligned byte
    tensors = _tensor_table(raw_infos, start, align, len(buf), path)
    return GGUFFile(path, metadata, tensors, buf)


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        cur.where = f"metadata key {i} of {n_kv}"
        key = cur.string()
        cur.where = f"the value of metadata key {key!r}"
        metadata[key] = cur.value(cur.scalar("I"))
    return metadata


def _read_tensor_infos(cur: _Cursor, n_tensors: int) -> list[tuple[str, list[int], int, int]]:
    raw_infos = []
    for i in range(n_tensors):
        cur.where = f"tensor info {i} of {n_tensors}"
        name = cur.string()
        cur.where = f"the tensor info of {name}"
        n_dims = cur.scalar("I")
        if n_dims > _MAX_DIMS:
            raise cur.corrupt(f"{name} has {n_dims} dimensions; GGUF allows at most {_MAX_DIMS}")
        dims = [cur.scalar("Q") for _ in range(n_dims)]
        raw_infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    return raw_infos


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    from gguf import GGUF_DEFAULT_ALIGNMENT

    align = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    # llama.cpp refuses the same: the data section and every tensor start on this boundary
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise ValueError(
            f"{path}: general.alignment = {align!r} must be a positive power of two; the file "
            f"is corrupt"
        )
    return align


def _tensor_table(
    raw_infos: list[tuple[str, list[int], int, int]],
    start: int,
    align: int,
    file_size: int,
    path: Path,
) -> dict[str, GGUFTensorInfo]:
    """The tensor infos checked as llama.cpp's ``gguf_init_from_file`` checks them: a known
    type, whole blocks per row, no duplicate names, and each tensor starting exactly where the
    one before it ends (padded to ``align``). That last rule is what every GGUF writer does and
    llama.cpp requires, and it catches a dimension or offset that disagrees with the data:
    otherwise one tensor's bytes would be read as another's, or a shape as a wrong one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors: dict[str, GGUFTensorInfo] = {}
    expected = 0  # where the next tensor must start, relative to the data section
    for name, dims, code, rel in raw_infos:
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has unknown type code {code}") from None
        if name in tensors:
            raise ValueError(f"{path}: the tensor table lists {name} twice; the file is corrupt")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise ValueError(
                f"{path}: tensor {name} has rows of {dims[0]} weights, not a whole number of "
                f"{qtype.name} blocks of {block}; its dimensions {dims} are corrupt"
            )
        n_bytes = math.prod(dims) * type_size // block  # Python ints: no overflow to wrap
        if rel != expected:
            raise ValueError(
                f"{path}: tensor {name} starts at data offset {rel}, but the tensors before it "
                f"end at {expected}; a dimension or an offset in the tensor table is corrupt"
            )
        if start + rel + n_bytes > file_size:
            raise ValueError(
                f"{path} is truncated or corrupt: tensor {name} (dimensions {dims}, "
                f"{qtype.name}) needs bytes up to {start + rel + n_bytes} but the file ends at "
                f"{file_size}"
            )
        expected = rel + -(-n_bytes // align) * align
        shape = tuple(int(d) for d in reversed(dims))  # GGUF dims are fastest-first
        tensors[name] = GGUFTensorInfo(name, shape, qtype.name, code, start + rel, n_bytes)
    return tensors

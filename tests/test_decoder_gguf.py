"""qkv's GGUF reading: the header parser against ``gguf.GGUFReader``, every
supported block type against ``gguf.quants``, the refusals, and the Q/K row order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import qkv.models
from decoder_testing import gguf_path
from qkv.models._gguf import SUPPORTED_TYPES, read_gguf
from qkv.models._llama_weights import unpermute_qk

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32("llama.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_equals_gguf_reader() -> None:
    """Every metadata field, every tensor's shape, type and bytes, as gguf's own reader has
    them (qkv parses the header itself: GGUFReader took 2.8-4.7 s on this file)."""
    ours = read_gguf(gguf_path())
    ref = gguf.GGUFReader(str(gguf_path()))
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(ours.metadata)
    for key, value in fields.items():
        got = ours.metadata[key]
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-7), key
        else:
            assert got == value, key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.type_name == t.tensor_type.name
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert np.array_equal(
            ours.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)
        )


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_every_supported_type_dequantises_as_gguf_does(tmp_path: Path, qtype: str) -> None:
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    q = gguf.quants.quantize(x, T[qtype])
    g = read_gguf(_write(tmp_path / "t.gguf", "llama", {"w": (q, T[qtype])}))
    got = g.tensor("w")
    assert got.shape == (6, 64) and got.dtype == torch.float32
    want = gguf.quants.dequantize(q, T[qtype]).reshape(6, 64)
    assert np.array_equal(got.numpy(), want)
    # and it is a faithful copy of x, to the format's precision
    tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 3e-2, "Q4_0": 0.4, "Q4_1": 0.4}[qtype]
    assert np.abs(got.numpy() - x).max() <= tol


def test_other_types_are_refused_by_name(tmp_path: Path) -> None:
    path = _write(tmp_path / "k.gguf", "llama", {"w": (np.zeros((2, 144), np.uint8), T.Q4_K)})
    with pytest.raises(ValueError, match=r"w is stored as Q4_K.*F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        read_gguf(path).tensor("w")


def test_another_architecture_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "gpt2.gguf", "gpt2", {"w": (np.zeros((2, 4), np.float32), T.F32)})
    with pytest.raises(ValueError, match=r"holds a 'gpt2' model; qkv's decoder reads Llama") as e:
        qkv.models.load(path)
    assert "\n" not in str(e.value)


def test_missing_and_non_gguf_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        qkv.models.load(tmp_path / "absent.gguf")
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"hello, this is not a model file at all")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        qkv.models.load(bad)


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows → interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_inverts_the_converters_permutation(n_heads: int) -> None:
    w = torch.randn(n_heads * 64, 40)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(w, n_heads), n_heads), w)
    assert not torch.equal(_llama_cpp_permute(w, n_heads), w)

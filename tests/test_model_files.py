"""Corrupt and nonsensical model files: never a raw internal error.

Every damaged file (a GGUF cut inside its header, a count or a dimension overwritten, a token
id out of range, a truncated ``model.safetensors``, a ``tokenizer.json`` that is not one) and
every configuration value that makes no sense (NaN or negative epsilon, head counts that do
not divide) is refused with one ``ValueError`` line that names the file and what is wrong,
before anything is allocated from an unvalidated count; ``qkv explain`` and ``qkv generate``
print that line and exit 2. The files are small synthetic ones written here (a 1-layer Llama
GGUF, a Hugging Face Llama folder), and the MiniLM package's files linked, never copied.
"""

from __future__ import annotations

import json
import math
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import qkv.models
from qkv import cli

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

# The tiny Llama: 32 features, 4 query heads of 8, 2 key/value heads, one layer.
D, H, HKV, FF, LAYERS = 32, 4, 2, 64, 1
TOKENS = ["<|endoftext|>", "a", "b", "c", "ab", "Ġ", "Ġa", "Ġab"]
MERGES = ["a b", "Ġ a", "Ġa b"]


@pytest.fixture(autouse=True)
def no_native_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny models decode on float32 weights: no compiler run for a one-layer toy."""
    monkeypatch.setenv("QKV_NATIVE", "0")


def _meta() -> dict[str, tuple[Any, Any]]:
    """The tiny model's metadata, key -> (value, GGUF type)."""
    return {
        "llama.block_count": (LAYERS, V.UINT32),
        "llama.context_length": (64, V.UINT32),
        "llama.embedding_length": (D, V.UINT32),
        "llama.feed_forward_length": (FF, V.UINT32),
        "llama.attention.head_count": (H, V.UINT32),
        "llama.attention.head_count_kv": (HKV, V.UINT32),
        "llama.rope.freq_base": (10000.0, V.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": ("default", V.STRING),
        "tokenizer.ggml.tokens": (TOKENS, V.ARRAY),
        "tokenizer.ggml.token_type": ([3] + [1] * (len(TOKENS) - 1), V.ARRAY),
        "tokenizer.ggml.merges": (MERGES, V.ARRAY),
        "tokenizer.ggml.bos_token_id": (0, V.UINT32),
        "tokenizer.ggml.eos_token_id": (0, V.UINT32),
    }


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in row-major (PyTorch) shape."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    hd = D // H
    out = {"token_embd.weight": w(len(TOKENS), D), "output_norm.weight": np.ones(D, np.float32)}
    for i in range(LAYERS):
        out |= {
            f"blk.{i}.attn_norm.weight": np.ones(D, np.float32),
            f"blk.{i}.attn_q.weight": w(H * hd, D),
            f"blk.{i}.attn_k.weight": w(HKV * hd, D),
            f"blk.{i}.attn_v.weight": w(HKV * hd, D),
            f"blk.{i}.attn_output.weight": w(D, H * hd),
            f"blk.{i}.ffn_norm.weight": np.ones(D, np.float32),
            f"blk.{i}.ffn_gate.weight": w(FF, D),
            f"blk.{i}.ffn_up.weight": w(FF, D),
            f"blk.{i}.ffn_down.weight": w(D, FF),
        }
    return out


def tiny_gguf(
    path: Path,
    meta: dict[str, tuple[Any, Any] | None] | None = None,
    qtypes: dict[str, Any] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write the tiny Llama GGUF at ``path``; ``meta`` overrides keys (None drops one),
    ``qtypes`` stores some tensors quantised (GGUF name -> GGMLQuantizationType) and ``extra``
    adds float32 tensors after the model's."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, kv in (_meta() | (meta or {})).items():
        if kv is not None:
            value, vtype = kv
            sub = None
            if vtype == V.ARRAY:
                sub = V.STRING if isinstance(value[0], str) else V.INT32
            w.add_key_value(key, value, vtype, sub_type=sub)
    for name, data in (_tensors() | (extra or {})).items():
        qtype = (qtypes or {}).get(name, T.F32)
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _patch(path: Path, anchor: bytes, skip: int, fmt: str, value: Any) -> Path:
    """Overwrite the field ``skip`` bytes after the end of ``anchor`` (a key or tensor name in
    the header) with ``struct.pack('<' + fmt, value)``."""
    data = bytearray(path.read_bytes())
    at = data.index(anchor) + len(anchor) + skip
    size = struct.calcsize("<" + fmt)
    data[at : at + size] = struct.pack("<" + fmt, value)
    path.write_bytes(bytes(data))
    return path


def _refused(path: Path, *fragments: str) -> str:
    """Load ``path``: it must raise one ValueError line naming the file and ``fragments``."""
    with pytest.raises(ValueError) as e:
        qkv.models.load(path)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert path.name in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


# ------------------------------------------------------------------------------------- GGUF


def test_the_tiny_gguf_loads_and_generates(tmp_path: Path) -> None:
    """The baseline every corrupt copy below is made from is a valid model."""
    model = qkv.models.load(tiny_gguf(tmp_path / "tiny.gguf"))
    assert isinstance(model, qkv.models.TextDecoder)
    assert (model.config.n_heads, model.config.n_kv_heads, model.config.head_dim) == (H, HKV, 8)
    assert isinstance(model.generate("ab ab", max_new_tokens=3), str)


def _header_end(path: Path) -> int:
    from qkv.models._gguf import read_gguf

    return min(t.offset for t in read_gguf(path).tensors.values())


@pytest.mark.parametrize("where", [0.02, 0.1, 0.3, 0.5, 0.8, 0.99])
def test_gguf_cut_inside_its_header(tmp_path: Path, where: float) -> None:
    """Was ``struct.error: unpack_from requires a buffer of at least ...``, or a short string
    read as if whole."""
    path = tiny_gguf(tmp_path / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: max(8, int(_header_end(path) * where))])
    _refused(path, "truncated")


def test_gguf_cut_inside_its_tensor_data(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-100])
    _refused(path, "truncated", "blk.0.ffn_down.weight")


# Where the counts of the header are: name -> (anchor, bytes after its end, struct format).
COUNTS = {
    "n_tensors": (b"GGUF", 4, "Q"),
    "n_kv": (b"GGUF", 12, "Q"),
    "tokens array": (b"tokenizer.ggml.tokens", 8, "Q"),  # after value type and item type
    "token_type array": (b"tokenizer.ggml.token_type", 8, "Q"),
    "one token's length": (b"tokenizer.ggml.tokens", 16, "Q"),
    "a key's length": (b"llama.block_count", 8, "Q"),  # the next key's length
    "a tensor's n_dims": (b"blk.0.attn_q.weight", 0, "I"),
    "a tensor's dimension": (b"blk.0.attn_q.weight", 4, "Q"),
}


@pytest.mark.parametrize(
    "count",
    [
        "n_tensors",
        "n_kv",
        "tokens array",
        "token_type array",
        "one token's length",
        "a key's length",
        "a tensor's n_dims",
        "a tensor's dimension",
    ],
)
@pytest.mark.parametrize("value", [2**40, 2**63 + 5])
def test_gguf_huge_count_is_refused_before_allocating(
    tmp_path: Path, count: str, value: int
) -> None:
    """Was OverflowError after ~770 MB of strings on SmolLM2's file, ``buffer is smaller than
    requested size`` or struct.error; now the count is checked against the bytes left. The
    file carries 16 MB of tensor data that a bad length would otherwise have decoded."""
    big = {"padding.weight": np.zeros((1024, 4096), np.float32)}
    path = tiny_gguf(tmp_path / "count.gguf", extra=big)
    anchor, skip, fmt = COUNTS[count]
    _patch(path, anchor, skip, fmt, value if fmt == "Q" else 2**31)
    tracemalloc.start()
    try:
        _refused(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MB allocated before refusing"


def test_gguf_token_id_out_of_range(tmp_path: Path) -> None:
    """Was ``IndexError: list index out of range``."""
    meta = {"tokenizer.ggml.bos_token_id": (1000, V.UINT32)}
    path = tiny_gguf(tmp_path / "bos.gguf", meta)
    _refused(path, "tokenizer.ggml.bos_token_id", "1000", f"{len(TOKENS)} tokens")
    meta = {"tokenizer.ggml.eos_token_id": (len(TOKENS), V.UINT32)}
    _refused(tiny_gguf(tmp_path / "eos.gguf", meta), "tokenizer.ggml.eos_token_id")


def test_gguf_block_dimension_that_disagrees_with_the_data(tmp_path: Path) -> None:
    """A Q8_0 row of 33 weights is not whole blocks of 32: was numpy's ``cannot reshape``."""
    path = tiny_gguf(tmp_path / "dim.gguf", qtypes={"blk.0.attn_q.weight": T.Q8_0})
    _patch(path, b"blk.0.attn_q.weight", 4, "Q", D + 1)
    _refused(path, "blk.0.attn_q.weight", "33", "Q8_0", "32")


def test_gguf_dimension_that_disagrees_with_the_offsets(tmp_path: Path) -> None:
    """attn_q said to have 31 rows while 32 are stored: the next tensor starts where 32 end.
    Was ``RuntimeError: shape '[4, 3, 2, 32]' is invalid`` (from the q/k row reorder)."""
    path = tiny_gguf(tmp_path / "dim.gguf")
    _patch(path, b"blk.0.attn_q.weight", 12, "Q", D - 1)
    _refused(path, "offset")


def test_gguf_tensor_offset_overwritten(tmp_path: Path) -> None:
    """An offset pointing into another tensor would read its bytes as these weights."""
    path = tiny_gguf(tmp_path / "off.gguf")
    # after the name: n_dims (4), two dims (16), the type (4), then the offset
    _patch(path, b"blk.0.attn_k.weight", 24, "Q", 0)
    _refused(path, "blk.0.attn_k.weight", "offset")


@pytest.mark.parametrize(
    ("key", "value", "fragments"),
    [
        ("llama.attention.layer_norm_rms_epsilon", (math.nan, V.FLOAT32), ("nan",)),
        ("llama.attention.layer_norm_rms_epsilon", (-0.5, V.FLOAT32), ("-0.5",)),
        ("llama.attention.layer_norm_rms_epsilon", (0.0, V.FLOAT32), ("0.0",)),
        ("llama.rope.freq_base", (math.inf, V.FLOAT32), ("inf",)),
        ("llama.rope.freq_base", (-10000.0, V.FLOAT32), ("-10000",)),
        ("llama.attention.head_count", ("four", V.STRING), ("'four'",)),
        ("llama.attention.head_count_kv", ([2], V.ARRAY), ("[2]",)),
        ("llama.attention.head_count_kv", (3, V.UINT32), ("divide",)),
        ("llama.attention.head_count", (3, V.UINT32), ("divide",)),
        ("llama.context_length", (0, V.UINT32), ("context",)),
        ("llama.embedding_length", (1.5, V.FLOAT32), ("1.5",)),
    ],
)
def test_gguf_metadata_that_makes_no_sense(
    tmp_path: Path, key: str, value: tuple[Any, Any], fragments: tuple[str, ...]
) -> None:
    """NaN and negative epsilons were accepted (and every output NaN); others were
    TypeError/ValueError from ``int()`` without the file or the key."""
    path = tiny_gguf(tmp_path / "meta.gguf", {key: value})
    msg = _refused(path, *fragments)
    assert key in msg or "heads" in msg, msg


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("tokenizer.ggml.tokens", None, "tokenizer.ggml.tokens"),
        ("tokenizer.ggml.tokens", ("abc", V.STRING), "tokenizer.ggml.tokens"),
        ("tokenizer.ggml.merges", (["ab"], V.ARRAY), "tokenizer.ggml.merges"),
        ("tokenizer.ggml.merges", (["a zz"], V.ARRAY), "tokenizer.ggml.merges"),
        # "bc" is not a token: the join of a merge must be one
        ("tokenizer.ggml.merges", (["b c"], V.ARRAY), "tokenizer.ggml.merges"),
        ("tokenizer.ggml.token_type", ([1, 1], V.ARRAY), "tokenizer.ggml.token_type"),
    ],
)
def test_gguf_tokenizer_metadata_that_is_not_a_tokenizer(
    tmp_path: Path, key: str, value: tuple[Any, Any] | None, fragment: str
) -> None:
    """Was KeyError, or the tokenizers library's bare ``Exception``."""
    _refused(tiny_gguf(tmp_path / "tok.gguf", {key: value}), fragment)


def test_gguf_vocabulary_larger_than_the_embedding_table(tmp_path: Path) -> None:
    """Token ids past the table's rows would fail as an IndexError mid-generation."""
    meta = {"llama.vocab_size": (len(TOKENS) - 2, V.UINT32)}
    _refused(tiny_gguf(tmp_path / "vocab.gguf", meta), "vocab")


# ------------------------------------------------------------------- Hugging Face Llama folder


def _hf_llama(folder: Path, **config: Any) -> Path:
    """The tiny Llama as a Hugging Face folder: config.json, model.safetensors, tokenizer.json."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir()
    conf = {
        "model_type": "llama",
        "vocab_size": len(TOKENS),
        "hidden_size": D,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": H,
        "num_key_value_heads": HKV,
        "intermediate_size": FF,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
    } | config
    (folder / "config.json").write_text(json.dumps(conf), encoding="utf-8")
    names = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    state = {}
    for gname, data in _tensors().items():
        parts = gname.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
        else:
            hf = f"{names[parts[0]]}.weight"
        state[hf] = torch.from_numpy(data)
    save_file(state, str(folder / "model.safetensors"))
    vocab = {t: i for i, t in enumerate(TOKENS)}
    pairs = [tuple(m.split(" ")) for m in MERGES]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_the_tiny_hf_llama_folder_loads(tmp_path: Path) -> None:
    model = qkv.models.load(_hf_llama(tmp_path / "tiny"))
    assert isinstance(model, qkv.models.TextDecoder)
    assert isinstance(model.generate("ab", max_new_tokens=2), str)


def test_truncated_safetensors_names_the_file(tmp_path: Path) -> None:
    """Was ``SafetensorError: Error while deserializing header: incomplete metadata, file not
    fully covered``, with no file named."""
    folder = _hf_llama(tmp_path / "tiny")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    msg = _refused(folder, "model.safetensors", "truncated")
    assert str(f) in msg


def test_safetensors_cut_inside_its_header(tmp_path: Path) -> None:
    folder = _hf_llama(tmp_path / "tiny")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:40])
    _refused(folder, "model.safetensors")


@pytest.mark.parametrize("text", ['{"version": "1.0", "model": ', '{"a": 1}', "[]", ""])
def test_tokenizer_json_that_is_not_a_tokenizer(tmp_path: Path, text: str) -> None:
    """Was the tokenizers library's bare ``Exception: expected `,` or `}` at line 1``."""
    folder = _hf_llama(tmp_path / "tiny")
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    _refused(folder, "tokenizer.json")


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"num_attention_heads": 5}, "divide"),
        ({"num_key_value_heads": 3}, "divide"),
        ({"hidden_size": "32"}, "hidden_size"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"eos_token_id": 1000}, "eos_token_id"),
        ({"bos_token_id": -1}, "bos_token_id"),
    ],
)
def test_hf_llama_config_that_makes_no_sense(
    tmp_path: Path, change: dict[str, Any], fragment: str
) -> None:
    folder = _hf_llama(tmp_path / "tiny", **change)
    _refused(folder, "config.json", fragment)


def test_hf_llama_config_missing_a_key(tmp_path: Path) -> None:
    """Was ``KeyError: 'intermediate_size'``."""
    folder = _hf_llama(tmp_path / "tiny")
    conf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    del conf["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(conf), encoding="utf-8")
    _refused(folder, "config.json", "intermediate_size")


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_hf_llama_side_file_that_is_not_json(tmp_path: Path, name: str) -> None:
    """Was a bare ``JSONDecodeError: Expecting value: line 1 column 1`` naming no file."""
    folder = _hf_llama(tmp_path / "tiny")
    (folder / name).write_text("not json", encoding="utf-8")
    _refused(folder, name)


# --------------------------------------------------------------------------- BERT (MiniLM)


def _minilm(tmp_path: Path, **config: Any) -> Path:
    """The MiniLM checkpoint's files linked into a folder of its own, config.json rewritten
    with ``config`` (the 90 MB of weights are linked, not copied)."""
    src = qkv.models.default_model_path()
    folder = tmp_path / "minilm"
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to(src / name)
    conf = json.loads((src / "config.json").read_text(encoding="utf-8")) | config
    (folder / "config.json").write_text(json.dumps(conf), encoding="utf-8")
    return folder


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"layer_norm_eps": math.nan}, "layer_norm_eps"),
        ({"layer_norm_eps": -1e-12}, "layer_norm_eps"),
        ({"layer_norm_eps": "small"}, "layer_norm_eps"),
        ({"hidden_dropout_prob": 3.0}, "hidden_dropout_prob"),
        ({"attention_probs_dropout_prob": -0.1}, "attention_probs_dropout_prob"),
        ({"pad_token_id": 40000}, "pad_token_id"),
    ],
)
def test_bert_config_that_makes_no_sense(
    tmp_path: Path, change: dict[str, Any], fragment: str
) -> None:
    """NaN and negative epsilons were accepted; a dropout of 3 failed in torch naming no
    file; a pad id past the table was torch's AssertionError."""
    folder = _minilm(tmp_path, **change)
    _refused(folder, "config.json", fragment)


def test_bert_truncated_safetensors_names_the_file(tmp_path: Path) -> None:
    folder = _minilm(tmp_path)
    weights = folder / "model.safetensors"
    head = weights.read_bytes()[: 2**20]  # the header and the first tensors, not the rest
    weights.unlink()
    weights.write_bytes(head)
    msg = _refused(folder, "truncated")
    assert str(weights) in msg


@pytest.mark.parametrize("text", ["{not json", '{"model": {"type": "WordPiece"}}'])
def test_bert_tokenizer_json_that_is_not_a_tokenizer(tmp_path: Path, text: str) -> None:
    folder = _minilm(tmp_path)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    _refused(folder, "tokenizer.json")


# ------------------------------------------------------------------------------------ CLI


@pytest.mark.parametrize("command", ["explain", "generate"])
@pytest.mark.parametrize("damage", ["cut header", "huge count", "bad token id", "nan eps"])
def test_cli_prints_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, damage: str
) -> None:
    """Was a full traceback and exit status 1."""
    path = tiny_gguf(tmp_path / "bad.gguf")
    if damage == "cut header":
        path.write_bytes(path.read_bytes()[:300])
    elif damage == "huge count":
        _patch(path, b"tokenizer.ggml.tokens", 8, "Q", 2**60)
    elif damage == "bad token id":
        tiny_gguf(path, {"tokenizer.ggml.eos_token_id": (99, V.UINT32)})
    else:
        tiny_gguf(path, {"llama.attention.layer_norm_rms_epsilon": (math.nan, V.FLOAT32)})
    args = ["ab"] if command == "generate" else []
    assert cli.main([command, *args, "--model", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"qkv {command}: error: "), err
    assert str(path) in err or path.name in err, err


def test_cli_bert_folder_with_a_bad_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _minilm(tmp_path)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").write_text("{", encoding="utf-8")
    assert cli.main(["explain", "--model", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "tokenizer.json" in err, err


def test_cli_generate_one_token_prints_no_unmeasured_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One new token comes with the prompt, so there is no decode rate; the
    line said "decode 1 tokens at 0.0 tokens/s"."""
    path = tiny_gguf(tmp_path / "tiny.gguf")
    assert cli.main(["generate", "ab ab", "--model", str(path), "--max-new-tokens", "1"]) == 0
    line = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[-1]
    assert line.startswith("[tiny on qkv: prompt ") and "tokens/s, decode 1 tokens]" in line
    assert "0.0 tokens/s" not in line


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("modules.json", '[{"idx": 0, "path": "", "type": "Transformer"}, 7]'),
        ("modules.json", '[{"idx": "first", "path": "", "type": "Transformer"}]'),
        ("sentence_bert_config.json", "[128]"),
        ("tokenizer_config.json", '"bert"'),
        ("sentence_bert_config.json", "\udcff"),  # not UTF-8 at all
    ],
)
def test_bert_side_file_that_is_not_a_json_object(tmp_path: Path, name: str, text: str) -> None:
    """Was AttributeError (``'list' object has no attribute 'get'``) or ValueError from int()
    or UnicodeDecodeError, none naming the file."""
    folder = _minilm(tmp_path)
    (folder / name).write_bytes(text.encode("utf-8", errors="surrogateescape"))
    _refused(folder, name)

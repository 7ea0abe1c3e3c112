"""A CTranslate2 Whisper folder (``model.bin``, ``config.json``, ``tokenizer.json``) → a
:class:`SpeechRecognizer` on qkv.

CTranslate2 stores each self-attention's Q, K and V projections as one ``linear_0`` (rows
concatenated), a cross-attention's K and V as one ``linear_1``, and no output head (the logits
use the token embedding). Weights are float16, bfloat16 or float32 and are converted to the
requested dtype; int8-quantised folders are refused.

``compute_type="int8"`` (faster-whisper's name) quantises every linear layer of both stacks
once, after loading, to int8 weights with one scale per output channel
(:class:`qkv.models.int8.Int8Linear`); the convolutions, layer norms, embeddings and attention
stay float32, as in CTranslate2's int8 mode on a CPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from ..int8 import quantize_linears
from ._ct2 import read_model_bin
from ._text import WhisperTokenizer
from .model import WhisperConfig
from .recognizer import SpeechRecognizer

__all__ = ["COMPUTE_TYPES", "check_compute_type", "is_whisper_folder", "load_ct2"]

_FILES = ("model.bin", "config.json", "tokenizer.json")
# faster-whisper's names: "int8_float32" is its explicit spelling of "int8" on a CPU
COMPUTE_TYPES = ("float32", "int8", "int8_float32")


def is_whisper_folder(p: Path) -> bool:
    """A folder whose model.bin says it holds a CTranslate2 WhisperSpec."""
    f = p / "model.bin"
    if not f.is_file():
        return False
    with open(f, "rb") as fh:
        head = fh.read(64)
    return b"WhisperSpec" in head


def check_compute_type(compute_type: object, dtype: torch.dtype) -> str:
    """``compute_type`` checked (one of :data:`COMPUTE_TYPES`) against ``dtype``: ``"int8"``
    or ``"float32"``."""
    if not isinstance(compute_type, str) or compute_type not in COMPUTE_TYPES:
        raise ValueError(
            f"compute_type={compute_type!r} is not supported; give one of "
            f"{', '.join(map(repr, COMPUTE_TYPES))} (faster-whisper's names)"
        )
    if compute_type == "float32":
        return "float32"
    if dtype != torch.float32:
        raise ValueError(
            f"compute_type={compute_type!r} computes in float32 around int8 weights; it takes "
            f"dtype=torch.float32, got {dtype}"
        )
    return "int8"


def load_ct2(
    path: Path, *, dtype: torch.dtype = torch.float32, compute_type: str = "float32"
) -> SpeechRecognizer:
    """The Whisper model in CTranslate2 folder ``path``, in eval mode; ``compute_type="int8"``
    quantises its linear layers (module docstring)."""
    compute = check_compute_type(compute_type, dtype)
    if not path.is_dir():
        raise FileNotFoundError(f"no such folder: {str(path)!r}; give a CTranslate2 Whisper folder")
    for name in _FILES:
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"{str(path)!r} has no {name}; a CTranslate2 Whisper folder holds "
                f"{', '.join(_FILES)} (ct2-transformers-converter --copy_files tokenizer.json)"
            )
    spec, var = read_model_bin(path / "model.bin")
    where = path / "model.bin"
    if spec != "WhisperSpec":
        raise ValueError(f"{where} holds a CTranslate2 {spec}, not a WhisperSpec")
    try:
        conf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    config = _config(var, where)
    tok = WhisperTokenizer(path / "tokenizer.json", multilingual=config.vocab_size >= 51865)
    heads = [(int(a), int(b)) for a, b in conf.get("alignment_heads", [])]
    if not heads:  # OpenAI's default: the upper half of the decoder's layers, every head
        half = config.n_text_layers // 2
        heads = [(i, h) for i in range(half, config.n_text_layers) for h in range(config.n_heads)]
    model = SpeechRecognizer(
        config,
        tok,
        alignment_heads=heads,
        suppress_blank=[int(i) for i in conf.get("suppress_ids_begin", [220, tok.eot])],
        path=path,
    )
    state = _state_dict(var, config, where)
    expected = model.state_dict()
    wrong = [k for k in expected if k not in state or state[k].shape != expected[k].shape]
    if wrong:
        raise ValueError(f"{where} does not fit the Whisper layout: {wrong[:3]} differ")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if compute == "int8":
        quantize_linears(model)
    model.compute_type = compute
    return model.eval()


def _scalar(var: dict[str, np.ndarray], name: str, where: Path) -> int:
    if name not in var:
        raise ValueError(f"{where} has no {name}; is it a Whisper model?")
    return int(var[name].reshape(-1)[0])


def _config(var: dict[str, np.ndarray], where: Path) -> WhisperConfig:
    need = ("encoder/conv1/weight", "decoder/embeddings/weight")
    for name in need:
        if name not in var:
            raise ValueError(f"{where} has no {name}; is it a Whisper model?")
    if var["encoder/conv1/weight"].dtype == np.int8:
        raise ValueError(
            f"{where} is int8-quantised; qkv reads float16/bfloat16/float32 CTranslate2 "
            f"models: convert with --quantization float16"
        )

    def count(prefix: str) -> int:
        return len({k.split("/")[1] for k in var if re.match(rf"{prefix}/layer_\d+/", k)})

    d_model = var["encoder/conv1/weight"].shape[0]
    return WhisperConfig(
        n_mels=var["encoder/conv1/weight"].shape[1],
        d_model=d_model,
        n_audio_layers=count("encoder"),
        n_audio_heads=_scalar(var, "encoder/num_heads", where),
        n_text_layers=count("decoder"),
        n_text_heads=_scalar(var, "decoder/num_heads", where),
        vocab_size=var["decoder/embeddings/weight"].shape[0],
        n_audio_ctx=var["encoder/position_encodings/encodings"].shape[0],
        n_text_ctx=var["decoder/position_encodings/encodings"].shape[0],
    )


def _state_dict(
    var: dict[str, np.ndarray], config: WhisperConfig, where: Path
) -> dict[str, torch.Tensor]:
    def t(name: str) -> torch.Tensor:
        if name not in var:
            raise ValueError(f"{where} has no {name}; is it a complete Whisper model?")
        return torch.from_numpy(var[name].astype(np.float32))

    def norm(dst: str, src: str) -> dict[str, torch.Tensor]:
        return {f"{dst}.weight": t(f"{src}/gamma"), f"{dst}.bias": t(f"{src}/beta")}

    def linear(dst: str, src: str) -> dict[str, torch.Tensor]:
        return {f"{dst}.weight": t(f"{src}/weight"), f"{dst}.bias": t(f"{src}/bias")}

    def split(dst: str, names: tuple[str, ...], src: str) -> dict[str, torch.Tensor]:
        w, b = t(f"{src}/weight"), t(f"{src}/bias")  # rows: the projections one after another
        d = config.d_model
        out = {}
        for i, name in enumerate(names):
            out[f"{dst}.{name}.weight"] = w[i * d : (i + 1) * d]
            out[f"{dst}.{name}.bias"] = b[i * d : (i + 1) * d]
        return out

    s: dict[str, torch.Tensor] = {
        **linear("encoder.conv1", "encoder/conv1"),
        **linear("encoder.conv2", "encoder/conv2"),
        "encoder.positions": t("encoder/position_encodings/encodings"),
        **norm("encoder.norm", "encoder/layer_norm"),
        "decoder.embed.weight": t("decoder/embeddings/weight"),
        "decoder.positions": t("decoder/position_encodings/encodings"),
        **norm("decoder.norm", "decoder/layer_norm"),
    }
    qkv_ = ("q_proj", "k_proj", "v_proj")
    for i in range(config.n_audio_layers):
        src, dst = f"encoder/layer_{i}", f"encoder.layers.{i}"
        s |= norm(f"{dst}.attn_norm", f"{src}/self_attention/layer_norm")
        s |= split(f"{dst}.attention", qkv_, f"{src}/self_attention/linear_0")
        s |= linear(f"{dst}.attention.out_proj", f"{src}/self_attention/linear_1")
        s |= norm(f"{dst}.mlp_norm", f"{src}/ffn/layer_norm")
        s |= linear(f"{dst}.mlp.fc1", f"{src}/ffn/linear_0")
        s |= linear(f"{dst}.mlp.fc2", f"{src}/ffn/linear_1")
    for i in range(config.n_text_layers):
        src, dst = f"decoder/layer_{i}", f"decoder.layers.{i}"
        s |= norm(f"{dst}.self_norm", f"{src}/self_attention/layer_norm")
        s |= split(f"{dst}.self_attention", qkv_, f"{src}/self_attention/linear_0")
        s |= linear(f"{dst}.self_attention.out_proj", f"{src}/self_attention/linear_1")
        s |= norm(f"{dst}.cross_norm", f"{src}/attention/layer_norm")
        s |= linear(f"{dst}.cross_attention.q_proj", f"{src}/attention/linear_0")
        s |= split(f"{dst}.cross_attention", qkv_[1:], f"{src}/attention/linear_1")
        s |= linear(f"{dst}.cross_attention.out_proj", f"{src}/attention/linear_2")
        s |= norm(f"{dst}.mlp_norm", f"{src}/ffn/layer_norm")
        s |= linear(f"{dst}.mlp.fc1", f"{src}/ffn/linear_0")
        s |= linear(f"{dst}.mlp.fc2", f"{src}/ffn/linear_1")
    return s

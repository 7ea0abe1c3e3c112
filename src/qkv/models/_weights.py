"""Hugging Face BERT tensor names → qkv module names, read with safetensors (never pickle).

The mapping, per layer ``i`` (HF ``encoder.layer.{i}.`` → qkv ``encoder.layers.{i}.``)::

    attention.self.{query,key,value}     → attention.{q,k,v}_proj   (a qkv.MultiHeadAttention)
    attention.output.dense               → attention.out_proj
    attention.output.LayerNorm           → attn_norm
    intermediate.dense                   → ffn_in
    output.dense                         → ffn_out
    output.LayerNorm                     → ffn_norm

and ``embeddings.{word,position,token_type}_embeddings`` → ``encoder.embeddings.{word,
position,token_type}``, ``embeddings.LayerNorm`` → ``encoder.embeddings.norm``. Checkpoints
saved from a model with a head (``BertForMaskedLM`` ...) prefix names with ``bert.``; old
ones call LayerNorm parameters ``gamma``/``beta``. Heads (``cls.*``) and the pooler are not
part of the encoder and are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

Tensor = torch.Tensor

__all__ = ["load_state_dict", "open_safetensors"]

_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "encoder.embeddings.word.weight",
    "embeddings.position_embeddings.weight": "encoder.embeddings.position.weight",
    "embeddings.token_type_embeddings.weight": "encoder.embeddings.token_type.weight",
    "embeddings.LayerNorm.weight": "encoder.embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "encoder.embeddings.norm.bias",
}
_LAYER = {
    "attention.self.query": "attention.q_proj",
    "attention.self.key": "attention.k_proj",
    "attention.self.value": "attention.v_proj",
    "attention.output.dense": "attention.out_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
    "output.LayerNorm": "ffn_norm",
}
_LAYER_NAME = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")
# Not part of the encoder: buffers, the pooler (a tanh layer on [CLS] that sentence embeddings
# do not use), and task heads.
_SKIPPED = re.compile(
    r"(embeddings\.position_ids|pooler\..*|cls\..*|qa_outputs\..*|classifier\..*)"
)


def _hf_to_qkv(name: str) -> str | None:
    """The qkv name of a HF tensor name, ``None`` to skip it; KeyError if unknown."""
    name = name.removeprefix("bert.")
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
        "LayerNorm.beta", "LayerNorm.bias"
    )
    if _SKIPPED.fullmatch(name):
        return None
    if name in _EMBEDDINGS:
        return _EMBEDDINGS[name]
    m = _LAYER_NAME.fullmatch(name)
    if m and m.group(2) in _LAYER:
        return f"encoder.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    raise KeyError(name)


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """``safetensors.safe_open(file)``; a truncated or damaged file (``SafetensorError:
    incomplete metadata, file not fully covered``, which names no file) is one ValueError
    naming it, whether found when the file is opened or when a tensor is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(
            f"{file} is not a readable safetensors file ({e}); it is truncated or damaged: "
            f"download it again"
        ) from None


def load_state_dict(
    files: tuple[Path, ...],
    expected: dict[str, tuple[torch.Size, torch.dtype]],
    *,
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """Read safetensors ``files`` into a qkv ``state_dict`` in ``dtype``.

    ``expected`` maps each qkv parameter name to its shape (and dtype, unused here): every one
    must be present with that shape, and no unknown encoder tensor may be left over, so that a
    checkpoint that does not match its ``config.json`` fails here and not with wrong numbers.
    """
    state: dict[str, Tensor] = {}
    unknown: list[str] = []
    for file in files:
        with open_safetensors(file) as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                try:
                    name = _hf_to_qkv(hf_name)
                except KeyError:
                    unknown.append(hf_name)
                    continue
                if name is None:
                    continue
                if name not in expected:
                    unknown.append(hf_name)
                    continue
                t = f.get_tensor(hf_name)
                shape = expected[name][0]
                if t.shape != shape:
                    raise ValueError(
                        f"{file.name}: tensor {hf_name} has shape {list(t.shape)} but config.json "
                        f"implies {list(shape)} for it; the weights and config.json do not match"
                    )
                if not t.is_floating_point():
                    raise TypeError(f"{file.name}: tensor {hf_name} has dtype {t.dtype}, not float")
                state[name] = t.to(dtype)
    missing = [n for n in expected if n not in state]
    if missing:
        raise ValueError(
            f"{', '.join(f.name for f in files)} lacks {len(missing)} of the {len(expected)} "
            f"tensors config.json calls for (first: {missing[:3]}, in qkv names); the weights "
            f"are incomplete or belong to another config"
        )
    if unknown:
        raise ValueError(
            f"{', '.join(f.name for f in files)} holds {len(unknown)} tensors a BERT encoder of "
            f"this config.json does not have (first: {unknown[:3]}); the weights belong to "
            f"another architecture or config"
        )
    return state

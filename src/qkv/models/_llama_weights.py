"""Llama tensor names → qkv module names, from a GGUF file or Hugging Face safetensors.

Per layer ``i`` (GGUF ``blk.{i}.`` / HF ``model.layers.{i}.`` → qkv ``layers.{i}.``)::

    GGUF            HF                                qkv
    attn_norm       input_layernorm                   attn_norm
    attn_q/k/v      self_attn.{q,k,v}_proj            attention.{q,k,v}_proj
    attn_output     self_attn.o_proj                  attention.out_proj
    ffn_norm        post_attention_layernorm          ffn_norm
    ffn_gate/up     mlp.{gate,up}_proj                gate, up
    ffn_down        mlp.down_proj                     down

and ``token_embd`` / ``model.embed_tokens`` → ``embed``, ``output_norm`` / ``model.norm`` →
``norm``, ``output`` / ``lm_head`` → ``lm_head`` (absent when tied to the embedding).

GGUF converters (llama.cpp's ``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorder the
rows of ``attn_q`` and ``attn_k`` within each head from the rotate-half layout that Hugging
Face and :class:`qkv.RotaryEmbedding` use (feature ``i`` paired with ``i + D/2``) to the
interleaved one llama.cpp's RoPE uses (``2i`` with ``2i + 1``); :func:`unpermute_qk` undoes it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ._gguf import GGUFFile
from ._llama_config import LlamaConfig

Tensor = torch.Tensor

__all__ = ["gguf_blocks", "gguf_state_dict", "hf_state_dict", "unpermute_qk"]

_GGUF_LAYER = {
    "attn_norm": "attn_norm",
    "attn_q": "attention.q_proj",
    "attn_k": "attention.k_proj",
    "attn_v": "attention.v_proj",
    "attn_output": "attention.out_proj",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}
_GGUF_TOP = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}
_HF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attention.q_proj",
    "self_attn.k_proj": "attention.k_proj",
    "self_attn.v_proj": "attention.v_proj",
    "self_attn.o_proj": "attention.out_proj",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}
_HF_TOP = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Undo the converters' RoPE row order: ``w [n_heads * D, d]`` with each head's rows in
    the order ``0, D/2, 1, D/2 + 1, ...`` back to ``0, 1, ..., D - 1``."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    w = w.view(n_heads, half, 2, cols).transpose(1, 2)  # [H, 2, D/2, d]
    return w.reshape(rows, cols)  # [H * D, d]


def _qkv_name(name: str, layer: dict[str, str], top: dict[str, str], prefix: str) -> str | None:
    m = re.fullmatch(rf"{prefix}(\d+)\.(.+)\.weight", name)
    if m and m.group(2) in layer:
        return f"layers.{m.group(1)}.{layer[m.group(2)]}.weight"
    m = re.fullmatch(r"(.+)\.weight", name)
    if m and m.group(1) in top:
        return f"{top[m.group(1)]}.weight"
    return None


def _check_complete(
    state: dict[str, Tensor],
    expected: dict[str, torch.Size],
    unknown: list[str],
    source: str,
) -> None:
    missing = [n for n in expected if n not in state]
    if missing:
        raise ValueError(
            f"{source} lacks {len(missing)} of the {len(expected)} tensors its config calls for "
            f"(first: {missing[:3]}, in qkv names); the file is incomplete or not a Llama model"
        )
    if unknown:
        raise ValueError(
            f"{source} holds {len(unknown)} tensors a Llama decoder does not have (first: "
            f"{unknown[:3]}); it belongs to another architecture or variant"
        )


def _shape_ok(name: str, t: Tensor, expected: dict[str, torch.Size], source: str) -> None:
    if t.shape != expected[name]:
        raise ValueError(
            f"{source}: tensor for {name} has shape {list(t.shape)} but the metadata implies "
            f"{list(expected[name])}; the weights and the config do not match"
        )


def gguf_state_dict(
    gguf: GGUFFile, config: LlamaConfig, expected: dict[str, torch.Size]
) -> dict[str, Tensor]:
    """The qkv ``state_dict`` (float32) of a Llama GGUF file; ``expected`` maps each qkv
    parameter name to its shape (``lm_head.weight`` only when the head is not tied)."""
    source = gguf.path.name
    names, unknown = _gguf_names(gguf, expected)
    raw = gguf.tensors_f32(list(names))
    state: dict[str, Tensor] = {}
    for gname, t in raw.items():
        name = names[gname]
        t = _unpermuted(name, t, config)
        _shape_ok(name, t, expected, source)
        state[name] = t
    _check_complete(state, expected, unknown, source)
    return state


def gguf_blocks(
    gguf: GGUFFile, config: LlamaConfig, expected: dict[str, torch.Size], formats: tuple[str, ...]
) -> dict[str, tuple[str, Tensor]]:
    """The quantised weights of a Llama GGUF file as stored: qkv parameter name → (format,
    uint8 ``[rows, bytes per row]``), for the tensors stored in one of ``formats``, q/k rows
    unpermuted as :func:`gguf_state_dict` does (a row of blocks is a row of weights)."""
    names, _ = _gguf_names(gguf, expected)
    out: dict[str, tuple[str, Tensor]] = {}
    for gname, name in names.items():
        fmt = gguf.tensors[gname].type_name
        if fmt in formats and len(expected[name]) == 2:
            rows = torch.from_numpy(gguf.raw(gname).copy())  # out of the read-only map
            out[name] = (fmt, _unpermuted(name, rows, config).contiguous())
    return out


def _gguf_names(
    gguf: GGUFFile, expected: dict[str, torch.Size]
) -> tuple[dict[str, str], list[str]]:
    """GGUF tensor name → qkv parameter name, and the GGUF names that map to none."""
    names: dict[str, str] = {}
    unknown: list[str] = []
    for gname in gguf.tensors:
        name = _qkv_name(gname, _GGUF_LAYER, _GGUF_TOP, r"blk\.")
        if name is None or name not in expected:
            unknown.append(gname)
        else:
            names[gname] = name
    return names, unknown


def _unpermuted(name: str, t: Tensor, config: LlamaConfig) -> Tensor:
    if name.endswith("q_proj.weight"):
        return unpermute_qk(t, config.n_heads)
    if name.endswith("k_proj.weight"):
        return unpermute_qk(t, config.n_kv_heads)
    return t


def hf_state_dict(
    files: tuple[Path, ...], expected: dict[str, torch.Size], *, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The qkv ``state_dict`` of Hugging Face Llama safetensors ``files`` (no permutation:
    Hugging Face stores q/k in the rotate-half layout already)."""
    from ._weights import open_safetensors

    source = ", ".join(f.name for f in files)
    state: dict[str, Tensor] = {}
    unknown: list[str] = []
    for file in files:
        with open_safetensors(file) as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer old checkpoints saved; qkv recomputes it
                name = _qkv_name(hf_name, _HF_LAYER, _HF_TOP, r"model\.layers\.")
                if name is None or name not in expected:
                    unknown.append(hf_name)
                    continue
                t = f.get_tensor(hf_name)
                _shape_ok(name, t, expected, source)
                state[name] = t.to(dtype)
    _check_complete(state, expected, unknown, source)
    return state

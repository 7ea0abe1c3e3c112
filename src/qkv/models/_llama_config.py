"""A Llama-family decoder's shape and options, from GGUF metadata or a Hugging Face
``config.json``: one frozen :class:`LlamaConfig` either way."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LlamaConfig",
    "config_from_gguf",
    "config_from_hf",
    "positive_float",
    "positive_int",
]


@dataclass(frozen=True)
class LlamaConfig:
    """What :class:`qkv.models.LlamaDecoder` is built from."""

    vocab_size: int  # rows of the token embedding table (and of the output head)
    d_model: int  # hidden width
    n_layers: int
    n_heads: int  # query heads; head_dim = d_model // n_heads
    n_kv_heads: int  # key/value heads (grouped-query attention when fewer)
    d_ff: int  # the SwiGLU block's inner width
    max_positions: int  # the context length the model was trained for
    rope_base: float  # RoPE's wavelength base (rope_theta)
    norm_eps: float  # epsilon of every RMSNorm
    tie_embeddings: bool  # the output head is the token embedding table
    name: str  # a display name ("SmolLM2-135M-Instruct", or the file/folder name)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def positive_int(value: Any, key: str, source: str) -> int:
    """``value`` (read from ``key`` of ``source``) as an int > 0, or one ValueError line."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{source}: {key} = {value!r} must be a positive integer")
    return value


def positive_float(value: Any, key: str, source: str, *, above: float = 0.0) -> float:
    """``value`` as a finite float > ``above``: a NaN or negative epsilon would make every
    output NaN (or silently different), so it is refused where it is read."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{source}: {key} = {value!r} must be a number")
    if not (math.isfinite(value) and value > above):
        raise ValueError(f"{source}: {key} = {value!r} must be a finite number > {above:g}")
    return float(value)


def _check(cfg: LlamaConfig, source: str, head_dim: int | None, rope_dim: int | None) -> None:
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
        if getattr(cfg, field) <= 0:
            raise ValueError(f"{source}: {field} = {getattr(cfg, field)} must be positive")
    if cfg.d_model % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(
            f"{source}: {cfg.d_model} features, {cfg.n_heads} query heads and {cfg.n_kv_heads} "
            f"key/value heads do not divide evenly; qkv's decoder needs d_model % n_heads == 0 "
            f"and n_heads % n_kv_heads == 0"
        )
    if cfg.head_dim % 2:  # RoPE rotates pairs of features
        raise ValueError(
            f"{source}: the head dimension d_model // n_heads = {cfg.head_dim} is odd; RoPE "
            f"needs an even one"
        )
    for what, dim in (("head dim", head_dim), ("RoPE dimension", rope_dim)):
        if dim is not None and dim != cfg.head_dim:
            raise ValueError(
                f"{source}: the {what} is {dim} but d_model // n_heads = {cfg.head_dim}; qkv's "
                f"decoder supports Llama models that rotate whole heads of d_model // n_heads"
            )


def config_from_gguf(meta: dict[str, Any], source: str, name: str) -> LlamaConfig:
    """The config of a GGUF file whose ``general.architecture`` is "llama"."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{source} holds a {arch!r} model; qkv's decoder reads Llama-architecture GGUF files "
            f"(general.architecture = 'llama': Llama, SmolLM, TinyLlama, Mistral-style)"
        )
    if meta.get("llama.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(
            f"{source}: RoPE scaling {meta['llama.rope.scaling.type']!r} is not supported; qkv's "
            f"decoder applies plain RoPE"
        )
    if meta.get("llama.expert_count"):
        raise ValueError(f"{source} is a mixture-of-experts model, which qkv does not support")

    def need(key: str) -> int:
        if key not in meta:
            raise ValueError(f"{source} lacks the metadata key {key!r} that a Llama GGUF has")
        return positive_int(meta[key], key, source)

    def number(key: str, default: float, above: float = 0.0) -> float:
        return positive_float(meta.get(key, default), key, source, above=above)

    n_heads = need("llama.attention.head_count")
    kv_key = "llama.attention.head_count_kv"
    if isinstance(meta.get(kv_key), list):
        raise ValueError(
            f"{source}: {kv_key} = {meta[kv_key]!r} gives each layer its own number of key/value "
            f"heads, which qkv's decoder does not support (one number for every layer)"
        )
    cfg = LlamaConfig(
        vocab_size=_gguf_vocab_size(meta, source),
        d_model=need("llama.embedding_length"),
        n_layers=need("llama.block_count"),
        n_heads=n_heads,
        n_kv_heads=positive_int(meta.get(kv_key, n_heads), kv_key, source),
        d_ff=need("llama.feed_forward_length"),
        max_positions=need("llama.context_length"),
        # RotaryEmbedding needs a base > 1 (its wavelengths grow with it)
        rope_base=number("llama.rope.freq_base", 10000.0, above=1.0),
        norm_eps=number("llama.attention.layer_norm_rms_epsilon", 1e-5),
        tie_embeddings=True,  # decided by the loader: no output.weight tensor means tied
        name=name,
    )
    head_dim = meta.get("llama.attention.key_length")
    _check(cfg, source, head_dim, meta.get("llama.rope.dimension_count"))
    return cfg


def _gguf_vocab_size(meta: dict[str, Any], source: str) -> int:
    """llama.vocab_size, or else the length of the vocabulary (as llama.cpp reads it)."""
    if "llama.vocab_size" in meta:
        return positive_int(meta["llama.vocab_size"], "llama.vocab_size", source)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(
            f"{source} has neither llama.vocab_size nor a tokenizer.ggml.tokens list; a Llama "
            f"GGUF has its vocabulary"
        )
    return len(tokens)


def config_from_hf(conf: dict[str, Any], source: str, name: str) -> LlamaConfig:
    """The config of a Hugging Face ``config.json`` with ``model_type`` "llama"."""
    if conf.get("model_type") != "llama":
        raise ValueError(
            f"{source} describes a {conf.get('model_type')!r} model; qkv's decoder reads "
            f"Llama checkpoints (model_type 'llama')"
        )
    scaling = conf.get("rope_scaling")
    if scaling and not isinstance(scaling, dict):
        raise ValueError(f"{source}: rope_scaling = {scaling!r} must be an object or null")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"{source}: rope_scaling {scaling} is not supported (plain RoPE only)")
    if conf.get("attention_bias") or conf.get("mlp_bias"):
        raise ValueError(f"{source}: attention_bias / mlp_bias are not supported")
    if conf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {conf['hidden_act']!r}; Llama uses 'silu'")

    def need(key: str, default: Any = None) -> int:
        if key not in conf and default is None:
            raise ValueError(f"{source} has no {key!r}; a Llama config.json needs it")
        return positive_int(conf.get(key, default), key, source)

    def number(key: str, default: float, above: float = 0.0) -> float:
        return positive_float(conf.get(key, default), key, source, above=above)

    n_heads = need("num_attention_heads")
    rope = conf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: rope_parameters = {rope!r} must be an object or null")
    kv_heads = conf.get("num_key_value_heads") or n_heads  # null or absent: one per query head
    cfg = LlamaConfig(
        vocab_size=need("vocab_size"),
        d_model=need("hidden_size"),
        n_layers=need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=positive_int(kv_heads, "num_key_value_heads", source),
        d_ff=need("intermediate_size"),
        max_positions=need("max_position_embeddings", 2048),
        rope_base=number("rope_theta", rope.get("rope_theta", 10000.0), above=1.0),
        norm_eps=number("rms_norm_eps", 1e-6),
        tie_embeddings=bool(conf.get("tie_word_embeddings", False)),
        name=name,
    )
    _check(cfg, source, conf.get("head_dim"), None)
    return cfg

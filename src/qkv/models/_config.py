"""Reading a Hugging Face checkpoint folder: which files are there, and what their configs say.

A checkpoint folder holds ``config.json`` (the encoder), ``model.safetensors`` (or sharded
``model-0000N-of-0000M.safetensors`` with ``model.safetensors.index.json``) and
``tokenizer.json``. A sentence-transformers folder adds ``modules.json`` (the pipeline:
Transformer → Pooling → Normalize), the pooling module's ``config.json`` and
``sentence_bert_config.json`` (``max_seq_length``). Everything here is plain JSON: no code from
the checkpoint is ever run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BertConfig", "Checkpoint", "PoolingConfig", "read_checkpoint"]

# The pipeline module types qkv understands, by the last part of their sentence-transformers
# class path (``sentence_transformers.models.Pooling`` and the newer module paths alike).
_ST_MODULES = ("Transformer", "Pooling", "Normalize")

# sentence-transformers' pooling modes, in the order its legacy boolean keys concatenate them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")


@dataclass(frozen=True)
class BertConfig:
    """The encoder's shape and options, read from ``config.json``."""

    vocab_size: int  # rows of the token embedding table
    d_model: int  # hidden_size: the width of every token vector
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads; head_dim = d_model // n_heads
    d_ff: int  # intermediate_size: the feed-forward block's inner width
    max_positions: int  # max_position_embeddings: the longest input the position table allows
    type_vocab_size: int  # segment (token type) embeddings; single texts use segment 0
    layer_norm_eps: float  # epsilon of every LayerNorm
    activation: str  # hidden_act of the feed-forward block
    pad_token_id: int  # the id batches are padded with (padded keys are masked anyway)
    attention_dropout: float  # attention_probs_dropout_prob (training mode only)
    hidden_dropout: float  # hidden_dropout_prob (training mode only)
    architecture: str  # config.json's architectures[0], e.g. "BertModel"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class PoolingConfig:
    """How token vectors become one sentence vector (sentence-transformers' pipeline)."""

    modes: tuple[str, ...]  # pooling modes, concatenated in this order; ("mean",) by default
    normalize: bool  # L2-normalise the pooled vector (a Normalize module in modules.json)
    max_seq_length: int  # encode() truncates each text to this many tokens, specials included
    lowercase: bool  # sentence_bert_config.json's do_lower_case: lowercase texts first


@dataclass(frozen=True)
class Checkpoint:
    """The files of a checkpoint folder and its parsed configs."""

    root: Path  # the folder that was given
    model_dir: Path  # where config.json, the weights and tokenizer.json are
    weight_files: tuple[Path, ...]  # one model.safetensors, or the shards in index order
    tokenizer_file: Path
    config: BertConfig
    pooling: PoolingConfig


def _read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint looks damaged") from e


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (a list or a string there would otherwise fail
    later as an AttributeError naming no file)."""
    value = _read_json(path)
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _listing(folder: Path) -> str:
    if not folder.is_dir():
        return "nothing (the folder does not exist)"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "nothing"
    shown = 12  # a big folder (say /tmp) must not turn the error into a wall of text
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _missing(folder: Path, name: str, why: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"checkpoint folder {folder} has no {name} ({why}); it contains: {_listing(folder)}. "
        f"qkv.models.load needs a Hugging Face folder with config.json, model.safetensors and "
        f"tokenizer.json"
    )


def _weight_files(folder: Path) -> tuple[Path, ...]:
    single = folder / "model.safetensors"
    if single.is_file():
        return (single,)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'; the checkpoint looks damaged")
        shards = tuple(folder / name for name in dict.fromkeys(weight_map.values()))
        for shard in shards:
            if not shard.is_file():
                raise _missing(folder, shard.name, f"a shard listed in {index.name}")
        return shards
    if any(
        (folder / n).is_file() for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack")
    ):
        raise FileNotFoundError(
            f"checkpoint folder {folder} has no model.safetensors, only pickle/TF/Flax weights; "
            f"qkv reads weights with safetensors only (loading a pickle can run arbitrary code). "
            f"Convert it once with transformers: "
            f"AutoModel.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)"
        )
    raise _missing(folder, "model.safetensors", "the weights")


def _int(cfg: dict[str, Any], key: str, file: Path, default: int | None = None) -> int:
    val = cfg.get(key, default)
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        if key not in cfg and default is None:
            raise ValueError(f"{file} has no '{key}'; a BERT config.json needs it")
        raise ValueError(f"{file}: '{key}' must be a positive integer, got {val!r}")
    return val


def _number(cfg: dict[str, Any], key: str, file: Path, default: float) -> float:
    val = cfg.get(key, default)
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise ValueError(f"{file}: '{key}' must be a number, got {val!r}")
    return float(val)


def _epsilon(cfg: dict[str, Any], key: str, file: Path, default: float) -> float:
    """A LayerNorm epsilon: finite and > 0 (a NaN one makes every output NaN, a negative one
    can divide by zero), refused where it is read."""
    val = _number(cfg, key, file, default)
    if not (math.isfinite(val) and val > 0):
        raise ValueError(f"{file}: '{key}' must be a finite number > 0, got {val!r}")
    return val


def _probability(cfg: dict[str, Any], key: str, file: Path, default: float) -> float:
    """A dropout probability, in [0, 1) (torch would refuse it only when the model is built,
    naming no file)."""
    val = _number(cfg, key, file, default)
    if not 0 <= val < 1:
        raise ValueError(f"{file}: '{key}' must be in [0, 1), got {val!r}")
    return val


def _pad_id(cfg: dict[str, Any], file: Path, vocab_size: int) -> int:
    """pad_token_id: absent or null means 0; an id past the embedding table is refused (torch
    would fail with ``AssertionError: Padding_idx must be within num_embeddings``)."""
    pad = cfg.get("pad_token_id")
    if pad is None:
        return 0
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < vocab_size:
        raise ValueError(
            f"{file}: 'pad_token_id' = {pad!r} must be a token id in 0..{vocab_size - 1} "
            f"(vocab_size is {vocab_size})"
        )
    return pad


def _bert_config(file: Path) -> BertConfig:
    cfg = _read_object(file)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or ["BertModel"]
    arch = str(archs[0])
    if model_type != "bert":
        raise ValueError(
            f"unsupported architecture: {file} has model_type {model_type!r} "
            f"(architectures {archs}); qkv.models supports BERT encoders "
            f"(model_type 'bert' with absolute position embeddings, e.g. all-MiniLM-L6-v2, "
            f"bert-base-uncased, BAAI/bge-small-en-v1.5)"
        )
    pos_type = cfg.get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ValueError(
            f"unsupported architecture: {file} has position_embedding_type {pos_type!r}; "
            f"qkv.models supports BERT encoders with 'absolute' position embeddings only"
        )
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError(
            f"unsupported architecture: {file} describes a BERT decoder (is_decoder or "
            f"add_cross_attention); qkv.models supports bidirectional BERT encoders"
        )
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"unsupported architecture: {file} has hidden_act {act!r}; supported: "
            f"{', '.join(ACTIVATIONS)}"
        )
    d_model = _int(cfg, "hidden_size", file)
    n_heads = _int(cfg, "num_attention_heads", file)
    if d_model % n_heads:
        raise ValueError(
            f"{file}: hidden_size={d_model} is not divisible by num_attention_heads={n_heads}"
        )
    vocab_size = _int(cfg, "vocab_size", file)
    return BertConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=_int(cfg, "num_hidden_layers", file),
        n_heads=n_heads,
        d_ff=_int(cfg, "intermediate_size", file),
        max_positions=_int(cfg, "max_position_embeddings", file),
        type_vocab_size=_int(cfg, "type_vocab_size", file, default=2),
        layer_norm_eps=_epsilon(cfg, "layer_norm_eps", file, 1e-12),
        activation=act,
        pad_token_id=_pad_id(cfg, file, vocab_size),
        attention_dropout=_probability(cfg, "attention_probs_dropout_prob", file, 0.1),
        hidden_dropout=_probability(cfg, "hidden_dropout_prob", file, 0.1),
        architecture=arch,
    )


def _pooling_modes(cfg: dict[str, Any], file: Path) -> tuple[str, ...]:
    mode = cfg.get("pooling_mode")
    if mode is not None:
        if not isinstance(mode, (str, list)):
            raise ValueError(f"{file}: pooling_mode must be a string or a list, got {mode!r}")
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(m for key, m in _LEGACY_POOLING_KEYS.items() if cfg.get(key, False))
    modes = modes or ("mean",)  # sentence-transformers' default when nothing is switched on
    for m in modes:
        if m not in POOLING_MODES:
            raise ValueError(
                f"{file}: unknown pooling mode {m!r}; supported: {', '.join(POOLING_MODES)}"
            )
    if not cfg.get("include_prompt", True):
        raise ValueError(
            f"{file}: include_prompt=false (pooling that skips an instruction prompt) is not "
            f"supported; qkv.models encodes texts without prompts"
        )
    return modes


def _sentence_pipeline(root: Path) -> tuple[Path, tuple[str, ...] | None, bool]:
    """``(model_dir, pooling modes or None for the default, normalize)`` from modules.json."""
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return root, None, False
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must hold a JSON list of modules")
    if not all(isinstance(e, dict) and isinstance(e.get("idx", 0), int) for e in modules):
        raise ValueError(
            f"{modules_file} must list module objects with integer 'idx' fields; the "
            f"checkpoint looks damaged"
        )
    model_dir, modes, normalize, seen = root, None, False, []
    for entry in sorted(modules, key=lambda e: int(e.get("idx", 0))):
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        path = root / str(entry.get("path", ""))
        if kind not in _ST_MODULES:
            raise ValueError(
                f"unsupported architecture: {modules_file} has a {entry.get('type')!r} module; "
                f"qkv.models supports sentence-transformers pipelines made of "
                f"{' → '.join(_ST_MODULES)} (no Dense or other heads)"
            )
        if kind in seen:
            raise ValueError(f"{modules_file} lists two {kind} modules; qkv supports one of each")
        seen.append(kind)
        if kind == "Transformer":
            model_dir = path
        elif kind == "Pooling":
            pool_file = path / "config.json"
            if not pool_file.is_file():
                raise _missing(path, "config.json", "the Pooling module's configuration")
            modes = _pooling_modes(_read_object(pool_file), pool_file)
        else:
            normalize = True
    if seen and seen[0] != "Transformer":
        raise ValueError(f"{modules_file} must start with the Transformer module, got {seen}")
    return model_dir, modes, normalize


def _max_seq_length(root: Path, model_dir: Path, config: BertConfig) -> tuple[int, bool]:
    """sentence-transformers' rule: sentence_bert_config.json's max_seq_length, else the
    smaller of the position table and the tokenizer's model_max_length; never more than the
    position table."""
    limit = config.max_positions
    lowercase = False
    for folder in dict.fromkeys((model_dir, root)):
        sbert = folder / "sentence_bert_config.json"
        if sbert.is_file():
            cfg = _read_object(sbert)
            lowercase = bool(cfg.get("do_lower_case", False))
            msl = cfg.get("max_seq_length")
            if isinstance(msl, int) and not isinstance(msl, bool) and msl > 0:
                return min(msl, limit), lowercase
            break
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        mml = _read_object(tok_cfg).get("model_max_length")
        if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0:
            limit = min(limit, mml)
    return limit, lowercase


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Check a checkpoint folder and parse its configs; raise naming what is missing or wrong."""
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"checkpoint folder {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(
            f"{root} is a file; qkv.models.load wants the checkpoint *folder* (with "
            f"config.json, model.safetensors and tokenizer.json)"
        )
    model_dir, modes, normalize = _sentence_pipeline(root)
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"{root / 'modules.json'} puts the Transformer module in {model_dir}, "
            f"which does not exist"
        )
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise _missing(model_dir, "config.json", "the encoder configuration")
    config = _bert_config(config_file)
    weights = _weight_files(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise _missing(model_dir, "tokenizer.json", "the fast tokenizer")
    max_len, lowercase = _max_seq_length(root, model_dir, config)
    pooling = PoolingConfig(
        modes=modes or ("mean",),  # no modules.json: sentence-transformers' mean pooling
        normalize=normalize,
        max_seq_length=max_len,
        lowercase=lowercase,
    )
    return Checkpoint(root, model_dir, weights, tokenizer_file, config, pooling)

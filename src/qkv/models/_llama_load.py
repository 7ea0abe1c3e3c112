"""Building a :class:`TextDecoder` from a GGUF file or a Hugging Face Llama folder."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ._chat import ChatTemplate
from ._gguf import GGUFFile
from ._llama_config import LlamaConfig, config_from_gguf, config_from_hf
from .decoder import TextDecoder
from .quantized import LinearPath

__all__ = ["load_gguf", "load_hf_llama"]

_IDS = ("bos", "eos", "eot")  # the special token ids a GGUF file may name


def _expected(model: TextDecoder) -> dict[str, torch.Size]:
    """qkv parameter name → shape, the tied head counted once (as ``embed.weight``)."""
    return {k: v.shape for k, v in model.decoder.named_parameters()}


def load_gguf(path: Path, *, dtype: torch.dtype) -> TextDecoder:
    from ._gguf import read_gguf
    from ._gguf_tokenizer import gguf_tokenizer, token_id, vocabulary
    from ._llama_weights import gguf_state_dict

    g = read_gguf(path)
    meta = g.metadata
    source = str(path)
    # The file name without its quantisation suffix ("SmolLM2-135M-Instruct.Q4_1.gguf" ->
    # "SmolLM2-135M-Instruct"): general.name is often a training-run label
    # ("Smollm2 135M 8k Lc100K Mix1 Ep2" in that file).
    name = re.sub(r"[.\-_](?:i?q\d\w*|f16|f32|bf16)$", "", path.stem, flags=re.IGNORECASE)
    tokens = vocabulary(meta, source)
    cfg = config_from_gguf(meta, source, name)
    _check_vocab_fits(len(tokens), cfg.vocab_size, source)
    tied = "output.weight" not in g.tensors
    cfg = LlamaConfig(**{**cfg.__dict__, "tie_embeddings": tied})
    tokenizer = gguf_tokenizer(meta, source)
    ids = {k: token_id(meta, f"tokenizer.ggml.{k}_token_id", len(tokens), source) for k in _IDS}
    eos_ids = tuple(dict.fromkeys(i for i in (ids["eos"], ids["eot"]) if i is not None))
    bos = ids["bos"]
    template = ChatTemplate(
        meta.get("tokenizer.chat_template"),
        bos_token=tokens[bos] if bos is not None else "",
        eos_token=tokens[eos_ids[0]] if eos_ids else "",
    )
    # The parameter shapes come from a model built with the config (a cheap one: its random
    # init is skipped, see _skeleton); the state dict is checked against them.
    shell = _skeleton(cfg, tokenizer, template, eos_ids, path)
    state = gguf_state_dict(g, cfg, _expected(shell))
    model = _fill(shell, state, dtype)
    model.linear_path = _gguf_linear_path(model, g, dtype)
    return model


def _check_vocab_fits(n_tokens: int, vocab_size: int, source: str) -> None:
    """A tokenizer with more tokens than the embedding table has rows would emit ids the model
    cannot look up (an IndexError in the middle of a generation)."""
    if n_tokens > vocab_size:
        raise ValueError(
            f"{source}: the tokenizer has {n_tokens} tokens but the model's vocab_size is "
            f"{vocab_size} (rows of its embedding table); the tokenizer and the weights do not "
            f"belong together"
        )


def _read_json(file: Path) -> Any:
    """A JSON file of a checkpoint folder, or one ValueError naming it."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); the checkpoint looks damaged") from None


def _json_object(file: Path) -> dict[str, Any]:
    value = _read_json(file) if file.is_file() else {}
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(value).__name__}")
    return value


def _gguf_linear_path(model: TextDecoder, g: GGUFFile, dtype: torch.dtype) -> LinearPath:
    """Keep the file's quantised blocks beside the float32 weights and give the few-row
    products (decoding) to the compiled kernel, when it can run."""
    from . import quantized
    from ._llama_weights import gguf_blocks

    if dtype != torch.float32:
        return LinearPath(None, (), f"the kernel computes in float32; the weights are {dtype}")
    if quantized.kernel() is None:
        return LinearPath(None, (), str(quantized.LIBRARY.disabled()))
    blocks = gguf_blocks(g, model.config, _expected(model), tuple(quantized.FORMATS))
    return quantized.use_blocks(model.decoder, blocks)


def load_hf_llama(folder: Path, *, dtype: torch.dtype) -> TextDecoder:
    from ._llama_weights import hf_state_dict
    from ._tokenizer import read_tokenizer

    conf_file = folder / "config.json"
    conf = _json_object(conf_file)
    cfg = config_from_hf(conf, str(conf_file), folder.name)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json; the decoder needs it")
    tokenizer = read_tokenizer(tok_file)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    _check_vocab_fits(
        tokenizer.get_vocab_size(with_added_tokens=True), cfg.vocab_size, str(tok_file)
    )
    tcfg = _json_object(folder / "tokenizer_config.json")
    source = tcfg.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if source is None and jinja.is_file():
        source = jinja.read_text(encoding="utf-8")
    eos, eos_file = conf.get("eos_token_id"), conf_file
    gen_file = folder / "generation_config.json"
    if "eos_token_id" in _json_object(gen_file):
        eos, eos_file = _json_object(gen_file)["eos_token_id"], gen_file
    eos_list = eos if isinstance(eos, list) else [eos] if eos is not None else []
    eos_ids = tuple(_hf_token_id(i, "eos_token_id", cfg.vocab_size, eos_file) for i in eos_list)
    bos = conf.get("bos_token_id")
    bos_id = (
        _hf_token_id(bos, "bos_token_id", cfg.vocab_size, conf_file) if bos is not None else None
    )

    def token(i: int | None) -> str:
        return str(tokenizer.id_to_token(i) or "") if i is not None else ""

    template = ChatTemplate(
        source,
        bos_token=token(bos_id),
        eos_token=token(eos_ids[0] if eos_ids else None),
    )
    files = _safetensors(folder)
    shell = _skeleton(cfg, tokenizer, template, eos_ids, folder)
    state = hf_state_dict(files, _expected(shell), dtype=dtype)
    return _fill(shell, state, dtype)


def _hf_token_id(i: Any, key: str, vocab_size: int, file: Path) -> int:
    """A special token id from a config file, refused unless the model has that token."""
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
        raise ValueError(
            f"{file}: {key} = {i!r} is not a token id of the model, whose vocab_size is "
            f"{vocab_size} (ids 0..{vocab_size - 1})"
        )
    return i


def _safetensors(folder: Path) -> tuple[Path, ...]:
    single = folder / "model.safetensors"
    if single.is_file():
        return (single,)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'; the checkpoint looks damaged")
        files = tuple(folder / str(f) for f in dict.fromkeys(weight_map.values()))
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} lists the shard {f.name}, which is missing")
        return files
    raise FileNotFoundError(f"{folder} has no model.safetensors (nor a sharded index)")


def _skeleton(
    cfg: LlamaConfig, tokenizer: Any, template: ChatTemplate, eos: tuple[int, ...], path: Path
) -> TextDecoder:
    """The model with uninitialised parameters: every one is replaced by the checkpoint's, so
    the random init (kaiming_uniform_ over SmolLM2's 135M weights: 0.9 s measured) would be
    wasted. The init functions are switched off while it is built, as transformers'
    ``no_init_weights`` does; building on the meta device instead cost 1.1 s (its first use
    imports torch._dynamo)."""
    from torch.nn import init

    saved = {
        n: getattr(init, n) for n in ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_")
    }
    try:
        for n in saved:
            setattr(init, n, lambda t, *a, **k: t)
        return TextDecoder(cfg, tokenizer, template, eos_ids=eos, path=path)
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


def _fill(model: TextDecoder, state: dict[str, torch.Tensor], dtype: torch.dtype) -> TextDecoder:
    state = {k: v if v.dtype == dtype else v.to(dtype) for k, v in state.items()}
    model.decoder.load_state_dict(state, strict=not model.config.tie_embeddings, assign=True)
    if model.config.tie_embeddings:  # assign=True replaced embed.weight: tie the head again
        model.decoder.lm_head.weight = model.decoder.embed.weight
    return model.eval()

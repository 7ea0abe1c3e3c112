"""Text → token ids with the checkpoint's own ``tokenizer.json`` (the ``tokenizers`` library).

A ``tokenizer.json`` may carry padding and truncation settings of its own (the packaged
all-MiniLM-L6-v2 pads and truncates every text to 128 tokens). They are switched off here:
batches are padded by :func:`pad_batch`, and truncation is applied only where asked for, with
the caller's limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

Tensor = torch.Tensor

__all__ = ["TextTokenizer", "pad_batch", "read_tokenizer"]


def read_tokenizer(file: Path) -> Any:
    """``tokenizers.Tokenizer.from_file``, with one ValueError naming the file when it is not
    a tokenizer (the library raises a bare ``Exception: expected `,` or `}` at line 1``)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises bare Exception for every failure
        msg = " ".join(str(e).split())
        raise ValueError(
            f"{file} is not a tokenizer.json the tokenizers library can read ({msg}); the "
            f"checkpoint's tokenizer file is damaged or of another kind: download it again"
        ) from None


class TextTokenizer:
    """Two views of one ``tokenizer.json``: whole texts, and texts cut to ``max_length``."""

    def __init__(self, file: Path, *, max_length: int, lowercase: bool = False) -> None:
        from tokenizers import Tokenizer, normalizers

        self.file = file
        self.max_length = max_length
        self._whole: Any = read_tokenizer(file)
        self._whole.no_padding()
        self._whole.no_truncation()
        if lowercase:
            # sentence_bert_config.json's do_lower_case: sentence-transformers puts a Lowercase
            # normalizer in front of the tokenizer's own, and so does qkv.
            old = self._whole.normalizer
            steps = [normalizers.Lowercase()] + ([old] if old is not None else [])
            self._whole.normalizer = normalizers.Sequence(steps)
        # A copy (via JSON) that truncates; the "longest_first" strategy and the post-processor's
        # special tokens ([CLS] ... [SEP]) are the same as transformers' tokenizer call with
        # truncation=True, max_length=max_length.
        self._cut: Any = Tokenizer.from_str(self._whole.to_str())
        self._cut.enable_truncation(max_length)

    @property
    def vocab_size(self) -> int:
        """The number of token ids it can produce, added tokens included."""
        return int(self._whole.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, truncate: bool = False) -> Any:
        """A ``tokenizers.Encoding`` (``.ids``, ``.tokens``, ``.offsets``) of one text."""
        return (self._cut if truncate else self._whole).encode(text)

    def encode_batch(self, texts: list[str], *, truncate: bool = False) -> list[Any]:
        return (self._cut if truncate else self._whole).encode_batch(texts)


def pad_batch(ids: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad token id lists into ``(input_ids [N, L] int64, lengths [N] int64)``.

    Padded positions hold ``pad_id``; the encoder masks them as keys and pooling skips them.
    """
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.int64)  # [N]
    L = int(lengths.max()) if len(ids) else 0
    out = torch.full((len(ids), L), pad_id, dtype=torch.int64)  # [N, L]
    for i, x in enumerate(ids):
        out[i, : len(x)] = torch.tensor(x, dtype=torch.int64)
    return out, lengths

"""The loaded model: tokenizer + :class:`BertEncoder` + sentence pooling, with the three calls a
user makes (``tokenize``, ``encode``, ``attention_maps``)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ._config import BertConfig, PoolingConfig
from ._packing import pack
from ._pooling import pool
from ._tokenizer import TextTokenizer, pad_batch
from .bert import BertEncoder, EncoderOutput

Tensor = torch.Tensor

__all__ = ["TextEncoder", "Tokens"]


class Tokens(NamedTuple):
    """One tokenized text, as :meth:`TextEncoder.tokenize` returns it: ``tokens`` (L strings),
    ``input_ids [1, L]``, ``attention_mask [1, L]`` and ``offsets`` (L character spans)."""

    tokens: list[str]  # L token strings, specials included: ["[CLS]", "the", ..., "[SEP]"]
    input_ids: Tensor  # [1, L] int64
    attention_mask: Tensor  # [1, L] int64, all ones (one text has no padding)
    # L (start, end) character spans of the tokens in the text; (0, 0) for [CLS] and [SEP]
    offsets: list[tuple[int, int]]


class TextEncoder(nn.Module):
    """A BERT-family sentence encoder running on :class:`qkv.MultiHeadAttention`.

    Made by :func:`qkv.models.load`. Attributes:

    - ``config``: :class:`~qkv.models.BertConfig` (``n_layers``, ``n_heads``, ``d_model``,
      ``max_positions``, ...).
    - ``pooling``: :class:`~qkv.models.PoolingConfig` (``modes``, ``normalize``,
      ``max_seq_length``).
    - ``encoder``: the :class:`~qkv.models.BertEncoder`; ``encoder.layers[i].attention`` is
      layer ``i``'s :class:`qkv.MultiHeadAttention` (hook it, or record it with
      ``qkv.inspect``), ``encoder.embeddings`` the embedding block.
    - ``path``: the checkpoint folder.

    Calling the model, ``model(input_ids, lengths=...)``, runs the encoder (see
    :meth:`BertEncoder.forward`): ``input_ids [B, L]`` → ``hidden [B, L, d_model]`` and more.
    ``encode(texts)`` gives ``[N, dim]`` sentence embeddings; ``attention_maps(text)`` gives
    ``(tokens, weights [layers, heads, L, L])``.
    """

    def __init__(
        self,
        config: BertConfig,
        pooling: PoolingConfig,
        tokenizer: TextTokenizer,
        *,
        path: Path,
    ) -> None:
        super().__init__()
        self.config = config
        self.pooling = pooling
        self.path = path
        self._tokenizer = tokenizer
        self.encoder = BertEncoder(config)

    @property
    def dim(self) -> int:
        """Width of the sentence vectors :meth:`encode` returns."""
        return len(self.pooling.modes) * self.config.d_model

    @property
    def max_seq_length(self) -> int:
        """:meth:`encode` truncates each text to this many tokens ([CLS] and [SEP] included)."""
        return self.pooling.max_seq_length

    @property
    def device(self) -> torch.device:
        return self.encoder.embeddings.word.weight.device

    def forward(
        self,
        input_ids: Tensor,
        *,
        lengths: Tensor | None = None,
        doc_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        """Token ids ``[B, L]`` → :class:`EncoderOutput`; see :meth:`BertEncoder.forward`."""
        return self.encoder(
            input_ids,
            lengths=lengths,
            doc_ids=doc_ids,
            token_type_ids=token_type_ids,
            need_weights=need_weights,
            output_hidden_states=output_hidden_states,
        )

    def tokenize(self, text: str) -> Tokens:
        """Tokenize one text, whole, with the checkpoint's tokenizer.

        Returns :class:`Tokens` ``(tokens, input_ids [1, L], attention_mask [1, L], offsets)``;
        ``tokens`` include ``[CLS]`` and ``[SEP]``. A text of more than
        ``config.max_positions`` tokens is refused with a ValueError (the position table has
        no rows for it); :meth:`encode` truncates instead.

        Example::

            >>> import qkv.models
            >>> model = qkv.models.load()
            >>> model.tokenize("The cat sat.").tokens
            ['[CLS]', 'the', 'cat', 'sat', '.', '[SEP]']
        """
        _check_text(text, "text")
        enc = self._tokenizer.encode(text)
        n_tokens = len(enc.ids)
        if n_tokens > self.config.max_positions:
            raise ValueError(
                f"the text is {n_tokens} tokens long ([CLS] and [SEP] included) but this model's "
                f"position table holds {self.config.max_positions}; shorten the text to fit "
                f"(model.encode truncates to {self.max_seq_length} tokens instead)"
            )
        ids = torch.tensor([enc.ids], dtype=torch.int64, device=self.device)  # [1, L]
        return Tokens(list(enc.tokens), ids, torch.ones_like(ids), list(enc.offsets))

    @torch.inference_mode()
    def attention_maps(self, text: str) -> tuple[list[str], Tensor]:
        """Every layer's and head's attention weights over one text.

        Returns ``(tokens, weights)``: the L tokens (as :meth:`tokenize`) and ``weights
        [n_layers, n_heads, L, L]`` (float32; row ``i`` of a head is what token ``i`` attends
        to, and sums to 1). Equal to ``transformers.BertModel`` with
        ``attn_implementation="eager"`` and ``output_attentions=True``.

        Example::

            >>> import qkv
            >>> tokens, w = qkv.models.load().attention_maps("The cat sat because it was tired.")
            >>> w.shape                               # [layers, heads, L, L]
            torch.Size([6, 12, 10, 10])
        """
        t = self.tokenize(text)
        with _eval(self):
            out = self.encoder(t.input_ids, need_weights=True)
        assert out.attentions is not None
        weights = torch.stack([w[0] for w in out.attentions]).float()  # [layers, H, L, L]
        return t.tokens, weights

    @torch.inference_mode()
    def encode(self, texts: list[str], *, batch_size: int = 32) -> Tensor:
        """Sentence embeddings with the checkpoint's pooling, normalisation and maximum length.

        Equal to ``sentence_transformers.SentenceTransformer(path).encode(texts)``: each text is
        tokenized and truncated to :attr:`max_seq_length` tokens (a UserWarning says how many
        were cut), texts are run in batches of ``batch_size`` sorted by length, pooled over
        their real tokens and, if the checkpoint says so, L2-normalised. Within a batch, short
        texts are packed several to a row of the longest one's length, kept apart by a document
        mask (positions restart per text), so no work goes to padding.

        Args:
            texts: a list of N strings (empty strings are fine).
            batch_size: texts per forward pass.

        Returns:
            ``[N, dim]`` float tensor on the model's device, in the order of ``texts``.

        Example::

            >>> import qkv
            >>> e = qkv.models.load().encode(["A cat.", "A dog.", ""])
            >>> e.shape
            torch.Size([3, 384])
        """
        if isinstance(texts, str):
            raise TypeError("encode takes a list of strings; for one text use model.encode([text])")
        if not isinstance(texts, (list, tuple)):
            raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}")
        for i, t in enumerate(texts):
            _check_text(t, f"texts[{i}]")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not texts:
            return torch.empty(
                0, self.dim, device=self.device, dtype=self.encoder.embeddings.word.weight.dtype
            )
        encs = self._tokenizer.encode_batch(list(texts), truncate=True)
        cut = sum(1 for e in encs if e.overflowing)
        if cut:
            warnings.warn(
                f"{cut} of {len(texts)} texts were longer than max_seq_length="
                f"{self.max_seq_length} tokens and were truncated to it (as sentence-transformers "
                f"does); their embeddings describe the first {self.max_seq_length} tokens only",
                UserWarning,
                stacklevel=2,
            )
        # Longest first, as sentence-transformers does, so that a batch holds similar lengths.
        order = sorted(range(len(encs)), key=lambda i: -len(encs[i].ids))
        dtype = self.encoder.embeddings.word.weight.dtype
        out = torch.empty(len(encs), self.dim, device=self.device, dtype=dtype)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            out[torch.tensor(idx, device=self.device)] = self._embed([encs[i].ids for i in idx])
        return out

    def _embed(self, ids: list[list[int]]) -> Tensor:
        """Pooled vectors ``[n, dim]`` of n token id lists, packed when that saves rows."""
        dev, pad = self.device, self.config.pad_token_id
        packed = pack(ids, pad)
        with _eval(self):
            if packed.input_ids.shape[0] < len(ids):  # several texts share a row
                rows = self.encoder(
                    packed.input_ids.to(dev), doc_ids=packed.doc_ids.to(dev)
                ).hidden  # [R, L, d]
                hidden = rows[packed.row.to(dev), packed.col.to(dev)]  # [n, L, d]
                lengths = packed.lengths.to(dev)  # [n]
            else:  # one text per row anyway: plain padding (no mask at all if equal lengths)
                input_ids, lengths = pad_batch(ids, pad)
                input_ids, lengths = input_ids.to(dev), lengths.to(dev)  # [n, L], [n]
                hidden = self.encoder(input_ids, lengths=lengths).hidden  # [n, L, d]
        return pool(hidden, lengths, self.pooling)  # [n, dim]

    def extra_repr(self) -> str:
        c, p = self.config, self.pooling
        return (
            f"path={str(self.path)!r}, layers={c.n_layers}, heads={c.n_heads}, "
            f"d_model={c.d_model}, pooling={'+'.join(p.modes)}, normalize={p.normalize}, "
            f"max_seq_length={p.max_seq_length}"
        )


@contextlib.contextmanager
def _eval(module: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the duration, then the module's own mode again: encode and
    attention_maps are deterministic even on a model someone is fine-tuning."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _check_text(text: object, name: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")

"""A BERT encoder whose every attention call is a :class:`qkv.MultiHeadAttention`.

The layer is BERT's post-norm block (Devlin et al. 2019, after Vaswani et al. 2017)::

    x = attn_norm(x + attention(x, mask=key padding))     # [B, L, d]
    x = ffn_norm(x + ffn_out(act(ffn_in(x))))             # [B, L, d]

The modules hold parameters only; :func:`qkv.models.load` fills them from a checkpoint.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..masks import padding
from ..modules import MultiHeadAttention
from ._config import BertConfig

Tensor = torch.Tensor

__all__ = ["BertEmbeddings", "BertEncoder", "BertLayer", "EncoderOutput"]


def _activation(name: str) -> nn.Module:
    # Hugging Face's names: "gelu" is the exact erf form, "gelu_new"/"gelu_pytorch_tanh" the tanh
    # approximation (transformers.activations).
    if name == "gelu":
        return nn.GELU()
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return nn.GELU(approximate="tanh")
    if name == "relu":
        return nn.ReLU()
    if name in ("silu", "swish"):
        return nn.SiLU()
    raise ValueError(f"unsupported activation {name!r}")  # _config refuses these earlier


class EncoderOutput(NamedTuple):
    """What :meth:`BertEncoder.forward` returns: ``hidden [B, L, d]``, ``hidden_states``
    (``n_layers + 1`` of ``[B, L, d]``, or ``None``) and ``attentions`` (``n_layers`` of
    ``[B, H, L, L]``, or ``None``)."""

    hidden: Tensor  # [B, L, d] the last layer's token vectors
    hidden_states: tuple[Tensor, ...] | None  # n_layers + 1 of [B, L, d]: embeddings, each layer
    attentions: tuple[Tensor, ...] | None  # n_layers of [B, H, L, L] attention weights


class BertEmbeddings(nn.Module):
    """Token + position + segment embeddings, then LayerNorm: ids ``[B, L]`` → ``[B, L, d]``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        d = config.d_model
        self.word = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_positions, d)
        self.token_type = nn.Embedding(config.type_vocab_size, d)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        if position_ids is None:
            L = input_ids.shape[1]
            pos = torch.arange(L, device=input_ids.device)  # [L] absolute positions 0..L-1
            x = self.word(input_ids) + self.position(pos)[None]  # [B, L, d]
        else:
            x = self.word(input_ids) + self.position(position_ids)  # [B, L, d]
        if token_type_ids is None:
            x = x + self.token_type.weight[0]  # single texts are all segment 0
        else:
            x = x + self.token_type(token_type_ids)
        return self.dropout(self.norm(x))  # [B, L, d]


class BertLayer(nn.Module):
    """One post-norm encoder block; ``attention`` is a :class:`qkv.MultiHeadAttention`.
    ``x [B, L, d]`` → ``(x [B, L, d], weights [B, H, L, L] or None)``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        d = config.d_model
        self.attention = MultiHeadAttention(
            d, config.n_heads, bias=True, dropout=config.attention_dropout
        )
        self.attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(d, config.d_ff)
        self.act = _activation(config.activation)
        self.ffn_out = nn.Linear(config.d_ff, d)
        self.ffn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self, x: Tensor, *, mask: object = None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """``x [B, L, d]`` → ``(x [B, L, d], weights [B, H, L, L] or None)``."""
        weights: Tensor | None = None
        if need_weights:
            a, weights = self.attention(x, mask=mask, need_weights=True)
        else:
            a = self.attention(x, mask=mask)
        x = self.attn_norm(x + self.dropout(a))  # [B, L, d]
        h = self.ffn_out(self.act(self.ffn_in(x)))  # [B, L, d]
        return self.ffn_norm(x + self.dropout(h)), weights


class BertEncoder(nn.Module):
    """The embeddings and the stack of layers: token ids ``[B, L]`` → token vectors
    ``[B, L, d]``. ``layers[i].attention`` is layer ``i``'s :class:`qkv.MultiHeadAttention`."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.n_layers))

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
        """Run the encoder.

        Args:
            input_ids: ``[B, L]`` integer token ids, right-padded; ``L <= config.max_positions``.
            lengths: ``[B]`` valid tokens per row (default: all ``L``). Keys at positions
                ``>= lengths[b]`` are masked (:func:`qkv.padding`); the outputs of padded
                query rows are not meaningful and pooling skips them.
            doc_ids: ``[B, L]`` for rows that pack several texts (instead of ``lengths``):
                each position's text, numbered within the row, each text one contiguous run;
                ``-1`` marks padding. A token attends to the tokens of its own text only (a
                document mask) and positions restart at 0 with each text, so every text gets
                exactly the vectors it would get alone.
            token_type_ids: ``[B, L]`` segment ids (default: all 0).
            need_weights: also return each layer's attention weights ``[B, H, L, L]``.
            output_hidden_states: also return the embeddings and every layer's output.

        Returns:
            :class:`EncoderOutput` ``(hidden [B, L, d], hidden_states, attentions)``.
        """
        _check_ids(input_ids, self.config)
        B, L = input_ids.shape
        mask: object = None
        position_ids = None
        if lengths is not None and doc_ids is not None:
            raise ValueError("give lengths (padded rows) or doc_ids (packed rows), not both")
        if lengths is not None:
            _check_lengths(lengths, B, L)
            if bool((lengths < L).any()):  # no padding: leave the fused unmasked path free
                mask = padding(lengths.to(input_ids.device))
        if doc_ids is not None:
            mask, position_ids = _packed(doc_ids, B, L)
        if token_type_ids is not None and token_type_ids.shape != input_ids.shape:
            raise ValueError(
                f"token_type_ids has shape {list(token_type_ids.shape)} but input_ids has "
                f"{list(input_ids.shape)}; give one segment id per token"
            )
        x = self.embeddings(input_ids, token_type_ids, position_ids)  # [B, L, d]
        states = [x] if output_hidden_states else None
        maps: list[Tensor] | None = [] if need_weights else None
        for layer in self.layers:
            x, w = layer(x, mask=mask, need_weights=need_weights)
            if states is not None:
                states.append(x)
            if maps is not None and w is not None:
                maps.append(w)
        return EncoderOutput(
            x,
            tuple(states) if states is not None else None,
            tuple(maps) if maps is not None else None,
        )


def _check_ids(input_ids: Tensor, config: BertConfig) -> None:
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be [B, L] with L >= 1, got shape {list(input_ids.shape)}; "
            f"use ids[None] for a single text"
        )
    n_tokens = input_ids.shape[1]
    if n_tokens > config.max_positions:
        raise ValueError(
            f"input_ids has {n_tokens} tokens but this model's position table holds "
            f"{config.max_positions}; shorten the text (encode() truncates for you)"
        )
    if input_ids.numel() and (
        int(input_ids.min()) < 0 or int(input_ids.max()) >= config.vocab_size
    ):
        raise ValueError(
            f"input_ids must lie in [0, {config.vocab_size}) (the vocabulary), got values in "
            f"[{int(input_ids.min())}, {int(input_ids.max())}]"
        )


def _check_lengths(lengths: Tensor, B: int, L: int) -> None:
    if not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point:
        raise TypeError("lengths must be an integer tensor [B] of valid tokens per row")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must have shape [{B}] (one per row), got {list(lengths.shape)}")
    if B and (int(lengths.min()) < 1 or int(lengths.max()) > L):
        raise ValueError(
            f"lengths must lie in [1, {L}] (the padded length), got {lengths.tolist()}"
        )


def _packed(doc_ids: Tensor, B: int, L: int) -> tuple[Tensor, Tensor]:
    """``(mask [B, 1, L, L] bool, position_ids [B, L])`` for rows of packed texts."""
    if not isinstance(doc_ids, Tensor) or doc_ids.dtype.is_floating_point:
        raise TypeError("doc_ids must be an integer tensor [B, L] (text number, -1 = padding)")
    if doc_ids.shape != (B, L):
        raise ValueError(
            f"doc_ids must have shape [{B}, {L}] like input_ids, got {list(doc_ids.shape)}"
        )
    idx = torch.arange(L, device=doc_ids.device)  # [L]
    starts = torch.ones_like(doc_ids, dtype=torch.bool)  # [B, L] True where a run begins
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    runs = (starts & (doc_ids >= 0)).sum(dim=1)  # [B]
    texts = torch.tensor([int(torch.unique(row[row >= 0]).numel()) for row in doc_ids])  # [B]
    if not torch.equal(runs.cpu(), texts):
        raise ValueError(
            "each text in doc_ids must be one contiguous run of positions, e.g. "
            "[0, 0, 0, 1, 1, -1]; got a text split into several runs"
        )
    run_start = torch.where(starts, idx, 0).cummax(dim=1).values  # [B, L] where each run began
    position_ids = (idx - run_start).clamp(max=L - 1)  # [B, L] restarts at 0 with each text
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, L, L]
    mask = same & (doc_ids >= 0)[:, None, :]  # [B, L, L] own text's keys, never padding
    return mask[:, None], position_ids  # [B, 1, L, L], [B, L]

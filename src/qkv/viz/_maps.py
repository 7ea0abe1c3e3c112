"""The one input every renderer takes: the tokens of a text and its attention weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class AttentionMaps:
    """Attention of one text through a model.

    Attributes:
        tokens: the ``L`` token strings (specials such as ``[CLS]`` included).
        weights: ``[layers, heads, L, L]`` float32 on the CPU; row ``i`` of a head is what token
            ``i`` attends to and sums to 1.
        text: the text the tokens came from.
        model: a short model name for titles.
    """

    tokens: list[str]
    weights: Tensor
    text: str = ""
    model: str = ""

    def __post_init__(self) -> None:
        w = self.weights
        L = len(self.tokens)
        if w.ndim != 4 or w.shape[2] != L or w.shape[3] != L:
            raise ValueError(
                f"weights must be [layers, heads, L, L] with L = {L} tokens, got {list(w.shape)}"
            )

    @property
    def n_layers(self) -> int:
        return self.weights.shape[0]

    @property
    def n_heads(self) -> int:
        return self.weights.shape[1]

    def row(self, layer: int, focus: int, head: int | None = None) -> Tensor:
        """``[L]`` weights of token ``focus`` in ``layer``: one head, or the mean of all heads."""
        w = self.weights[layer, :, focus]  # [heads, L]
        return w.mean(0) if head is None else w[head]

    def top(
        self, layer: int, focus: int, k: int, head: int | None = None
    ) -> list[tuple[int, float]]:
        """The ``k`` keys token ``focus`` attends to most: ``[(position, weight), ...]``."""
        vals, idx = self.row(layer, focus, head).topk(min(k, len(self.tokens)))
        return list(zip(idx.tolist(), vals.tolist(), strict=True))

    def entropy(self, layer: int, focus: int) -> Tensor:
        """``[heads]`` entropy (nats) of token ``focus``'s weights in each head of ``layer``."""
        w = self.weights[layer, :, focus].double()  # [heads, L]
        return -torch.special.xlogy(w, w).sum(-1)

    def most_focused_head(self, layer: int, focus: int) -> tuple[int, float]:
        """The head of ``layer`` whose weights for ``focus`` have the lowest entropy."""
        ent = self.entropy(layer, focus)
        h = int(ent.argmin())
        return h, float(ent[h])

    @property
    def max_entropy(self) -> float:
        """``log(L)``: the entropy of uniform attention over every token."""
        return math.log(max(len(self.tokens), 1))

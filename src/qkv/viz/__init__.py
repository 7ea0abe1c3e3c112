"""Renderers for attention maps: terminal tables (rich), PNG heatmaps (matplotlib Agg) and a
self-contained interactive HTML page. Used by ``qkv explain``; each renderer imports its
library only when called, so ``import qkv`` never pays for them.

They all take an :class:`AttentionMaps`: the tokens of one text and its weights
``[layers, heads, L, L]``.
"""

from ._maps import AttentionMaps

__all__ = ["AttentionMaps"]

"""qkv: attention for PyTorch: exact, flexible, inspectable, fast.

The public surface is what this module re-exports (``__all__``); everything else is private.
"""

import importlib
from typing import TYPE_CHECKING, Any

from . import inspect, reference
from .blockmask import BlockMask, block_mask
from .cache import KVCache, SlidingWindowCache
from .cross_cache import CrossKVCache
from .functional import attention
from .masks import and_masks, causal, document, or_masks, padding, prefix_lm, sliding_window
from .modules import MultiHeadAttention
from .planner import Plan, plan, set_dense_limit
from .rope import RotaryEmbedding
from .scores import alibi, alibi_slopes, relative_bias, softcap
from .sdpa_override import override_sdpa
from .torch_sdpa import scaled_dot_product_attention

if TYPE_CHECKING:
    from . import models

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # qkv.models (real checkpoints: tokenizers, GGUF, safetensors) is imported on first use,
    # so `import qkv` loads no model code.
    if name == "models":
        return importlib.import_module(".models", __name__)
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "models"})


__all__ = [
    "BlockMask",
    "CrossKVCache",
    "KVCache",
    "MultiHeadAttention",
    "Plan",
    "RotaryEmbedding",
    "SlidingWindowCache",
    "__version__",
    "alibi",
    "alibi_slopes",
    "and_masks",
    "attention",
    "block_mask",
    "causal",
    "document",
    "inspect",
    "models",
    "or_masks",
    "override_sdpa",
    "padding",
    "plan",
    "prefix_lm",
    "reference",
    "relative_bias",
    "scaled_dot_product_attention",
    "set_dense_limit",
    "sliding_window",
    "softcap",
]

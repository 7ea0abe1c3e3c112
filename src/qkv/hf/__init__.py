"""qkv as a Hugging Face transformers attention implementation.

::

    import qkv.hf                                        # registers "qkv"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="qkv")
    model.set_attn_implementation("qkv")                 # or switch a loaded model

Importing ``qkv.hf`` registers the name ``"qkv"`` (:func:`register`; two entries added to
transformers' registries, nothing else changed until a model asks for that name), so
``attn_implementation="qkv"`` works after the import alone; ``register(name=...)`` adds
another name. :func:`register` puts two functions under one name: :func:`attention_forward` in
``transformers.AttentionInterface`` (every attention layer calls it) and :func:`mask_function`
in ``transformers.masking_utils.AttentionMaskInterface`` (transformers builds each forward's
masks with it; without it transformers would pass no mask at all and lose padding, windows and
causality). The mask function reads transformers' own mask description — its mask_function
closures, the cache's offsets, the 2-D padding mask — and gives every layer a qkv mask, never a
dense ``[B, 1, Lq, Lk]`` tensor, so sliding windows, chunks, packed documents and padding are
planned block-sparse; causal with no padding reaches SDPA's ``is_causal`` path.

Differences from ``eager`` (documented in the README): a query row whose keys are all masked
(a left-padding position) is 0 here and uniform over the masked keys in eager — neither is
meaningful, and real tokens never see those rows; ``output_attentions`` under dropout returns
the weights before dropout.

``import qkv`` never imports transformers; ``import qkv.hf`` needs it
(``pip install 'qkv[hf]'``).
"""

from __future__ import annotations

try:
    from transformers import AttentionInterface as _AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface as _AttentionMaskInterface
except ImportError as _e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"qkv.hf needs Hugging Face transformers: pip install 'qkv[hf]' (importing it failed: {_e})"
    ) from _e

from ._attention import attention_forward
from ._maps import attention_maps
from ._mask import HFMask, mask_function

__all__ = ["HFMask", "attention_forward", "attention_maps", "mask_function", "register"]

NAME = "qkv"


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` run on qkv in every transformers model; returns
    ``name``. Idempotent: registering again replaces the same two entries.

    Registers :func:`attention_forward` in ``transformers.AttentionInterface`` and
    :func:`mask_function` in ``transformers.masking_utils.AttentionMaskInterface`` (on the
    classes, which is where transformers looks them up).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register() needs a non-empty name, got {name!r}")
    if name in ("eager", "sdpa", "flex_attention") or name.startswith(("flash_", "paged|")):
        raise ValueError(
            f"register(name={name!r}) would replace one of transformers' own attention "
            f"implementations; choose another name (the default is {NAME!r})"
        )
    _AttentionInterface.register(name, attention_forward)
    _AttentionMaskInterface.register(name, mask_function)
    return name


# The import registers the default name: `import qkv.hf` then attn_implementation="qkv" is
# what users write (transformers' own error otherwise names no qkv function to call first).
register()

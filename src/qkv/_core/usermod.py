"""A user's mask_mod or score_mod as qkv calls it.

qkv calls mods with broadcastable index tensors. A mod written for FlexAttention's
convention (scalar indices under ``torch.vmap``) is wrapped once, where it is adopted
(``qkv._flex.compat``), in a subclass of :class:`UserMod`; the layers here read only what
this base says (the mod itself, and whether it must go through vmap), so they need nothing
of the FlexAttention layer above them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class UserMod:
    """A user's mod (``fn``) and how it is called: ``why`` says why it needs vmap
    (``None``: broadcasting works), ``decided`` whether that is known yet (a score_mod
    decides on its first call)."""

    def __init__(self, fn: Callable[..., Any], why: str | None, decided: bool) -> None:
        # fn stays an attribute: the block-sparse backward finds a score_mod's learnable
        # captured tensors by looking into it (backends/blocksparse.py, _captured).
        self.fn, self.why, self.decided = fn, why, decided

    @property
    def vmap_only(self) -> bool:
        """Known to work only under FlexAttention's convention (called through vmap)."""
        return self.decided and self.why is not None


def unwrapped(mod: object) -> object:
    """The user's own mod behind qkv's wrapper (the key its decisions are kept under)."""
    return mod.fn if isinstance(mod, UserMod) else mod

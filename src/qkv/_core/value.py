"""Built-in masks and scores as values: equal and hashed by their parameters."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


class Value:
    """A built-in mask or score as a value: equal to another of its class with equal
    parameters (:meth:`params`), and hashed by them, so ``sliding_window(256)`` written inside
    ``forward`` equals the one made at the last call and finds its kept decision. A tensor
    among the parameters (document ids, padding lengths, ALiBi slopes) is a leaf compared by
    identity, never by value (comparing values would read them: a sync on a GPU, a graph
    break under torch.compile); two masks on one tensor read the same values, so they are
    equal before and after an in-place edit, and a call's signature token adds the tensor's
    version (``qkv._core.kindspec.value_token``), so an edit is a new decision. A user's mod
    among them (a combination's part) compares as Python compares it (by identity, for a
    function). Never edited after it is made."""

    # True when every parameter is a plain number (no tensor, no user mod): the value is then
    # its own signature token (qkv._core.kindspec.value_token), with no tuple made per call
    plain = False

    def params(self) -> tuple[object, ...]:
        """What this value is made of (its class aside)."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if type(other) is not type(self):
            return NotImplemented
        if self.plain:  # numbers only: a tuple compare (a repeat call's lookup makes one)
            return self.params() == other.params()
        return _same(self.params(), other.params())

    def __hash__(self) -> int:
        # computed once: a value never changes, and a repeat call hashes its mask's token
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            p = self.params()
            h = self.__dict__["_hash"] = hash((type(self), p if self.plain else _identities(p)))
        return h


def _same(a: object, b: object) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _identities(x: object) -> object:
    if isinstance(x, Tensor):
        return id(x)
    if isinstance(x, tuple):
        return tuple(_identities(i) for i in x)
    return x

"""qkv's one cache policy: bounded, least recently used out first, one entry at a time.

Every store of decisions and plans keyed by a call's values (kept plans under signatures, the
compiled operators' jobs and parsed specs, tile plans of built-in masks) is an :class:`LRU`,
so none grows without bound and none drops every entry at once when it is full (a model with
more signatures than the bound used to lose all of them, every layer, every call).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A dict of at most ``maxsize`` entries; a hit makes its entry the newest, and an insert
    past the bound drops the oldest (``on_evict(key)`` is called for it)."""

    def __init__(self, maxsize: int, on_evict: Callable[[K], None] | None = None) -> None:
        if maxsize < 1:
            raise ValueError(f"an LRU holds at least one entry, got maxsize={maxsize}")
        self.maxsize = maxsize
        self._on_evict = on_evict
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The entry under ``key`` (now the newest), or ``None``."""
        data = self._data
        got = data.get(key)
        if got is not None:
            data.move_to_end(key)
        return got

    def put(self, key: K, value: V) -> None:
        data = self._data
        data[key] = value
        data.move_to_end(key)
        while len(data) > self.maxsize:
            old, _ = data.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(old)

    def pop(self, key: K) -> V | None:
        return self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[K]:
        """The keys, oldest first."""
        return iter(list(self._data))

    def values(self) -> list[V]:
        return list(self._data.values())

    def items(self) -> list[tuple[K, V]]:
        return list(self._data.items())

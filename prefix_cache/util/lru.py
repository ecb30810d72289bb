"""An LRU map bounded in bytes (and optionally in entries): the one eviction policy of the memory
store, the per-tenant quota ledger and the engine's KV stores.

Each entry has a size its owner computes; a put evicts the least recently used entries until the
map is within its bounds again and returns them, so the owner can release what they hold. Not
thread-safe by itself: every owner already holds a lock that guards more than this map.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """Least recently used first out, at most ``max_bytes`` (and ``max_entries``) in all."""

    def __init__(self, max_bytes: int, max_entries: int | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if max_entries is not None and max_entries <= 0:
            raise ValueError(f"max_entries must be positive or None, got {max_entries}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.nbytes = 0
        self.evictions = 0
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._items)

    def items(self) -> Iterator[tuple[K, V]]:
        """``(key, value)`` pairs, least recently used first."""
        return ((k, v) for k, (v, _) in self._items.items())

    def peek(self, key: K) -> V | None:
        """The value, without making it recently used."""
        item = self._items.get(key)
        return None if item is None else item[0]

    def oldest(self) -> tuple[K, V] | None:
        """The least recently used pair, left in place; None when empty."""
        for key, (value, _) in self._items.items():
            return key, value
        return None

    def get(self, key: K) -> V | None:
        """The value, now the most recently used."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: K, value: V, size: int) -> list[tuple[K, V]] | None:
        """Store ``value`` (replacing ``key``'s) as the most recently used and evict until within
        bounds; the evicted pairs. None, with nothing changed, when ``size`` alone is more than
        ``max_bytes``: caching it would evict everything for nothing."""
        if size > self.max_bytes:
            return None
        self.pop(key)
        self._items[key] = (value, size)
        self.nbytes += size
        evicted = []
        while self.nbytes > self.max_bytes or (
                self.max_entries is not None and len(self._items) > self.max_entries):
            old_key, (old_value, old_size) = self._items.popitem(last=False)
            self.nbytes -= old_size
            evicted.append((old_key, old_value))
        self.evictions += len(evicted)
        return evicted

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value, or None if it was not there."""
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.nbytes -= item[1]
        return item[0]

    def pop_where(self, doomed: Callable[[K, V], bool]) -> list[tuple[K, V]]:
        """Remove every entry ``doomed(key, value)`` picks; the removed pairs."""
        picked = [(k, v) for k, (v, _) in self._items.items() if doomed(k, v)]
        for k, _ in picked:
            self.pop(k)
        return picked

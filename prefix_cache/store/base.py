"""The store interface every backend implements, and the contract the cache relies on.

Four operations, each in a sync and an async form. Backends raise ``StoreUnavailableError`` and
nothing else for any failure of their own (down, slow, full), so the cache has one thing to catch
and turn into a miss. The async forms default to the sync ones, which is right for a store that
never blocks (memory); network stores override them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any


class Store(ABC):
    """A bytes key-value store with optional per-entry TTL."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None if absent or expired."""

    @abstractmethod
    def put(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        """Store ``value``; ``ttl_seconds`` None means the store's default."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""

    @abstractmethod
    def purge(self, pattern: str) -> int:
        """Remove every key matching a glob ``pattern`` (``*`` and ``?``); the count removed."""

    async def aget(self, key: str) -> bytes | None:
        return self.get(key)

    async def aput(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        self.put(key, value, ttl_seconds)

    async def adelete(self, key: str) -> bool:
        return self.delete(key)

    async def apurge(self, pattern: str) -> int:
        return self.purge(pattern)

    def scan(self, pattern: str) -> Iterator[tuple[str, int]]:
        """(key, value bytes) for every key matching ``pattern``, for inventories; may be slow."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its keys")

    def stats(self) -> dict[str, Any]:
        """Backend figures for metrics (entries, bytes, evictions ...); may be empty."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for stores without resources
        """Release connections; the store is not used afterwards."""

"""In-process LRU store bounded in bytes (and optionally entries), with optional TTL.

The reference backend: every other store must pass the same contract tests. One lock guards
the map; no operation awaits or blocks while holding it, so it is safe from threads and from
asyncio tasks alike.
"""

from __future__ import annotations

import fnmatch
import re
import threading
import time
from collections.abc import Callable, Iterator

from ..util.lru import ByteLRU
from .base import MemoryStats, Store, StoreStats

# Per-entry bookkeeping (dict slot, tuple, str and bytes headers), so a store of tiny values is
# still bounded by something close to the memory it really takes.
ENTRY_OVERHEAD_BYTES = 160
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


def entry_size(key: str, value: bytes) -> int:
    """What an entry costs in the store (the tenant quotas count it the same way)."""
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES


class MemoryStore(Store):
    """LRU over ``max_bytes`` (and ``max_entries`` if set); entries expire after ``ttl_seconds``."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_entries: int | None = None,
        ttl_seconds: float | None = None,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive or None, got {ttl_seconds}")
        self._lru: ByteLRU[str, tuple[bytes, float | None]] = ByteLRU(max_bytes, max_entries)
        self.ttl_seconds = ttl_seconds
        self._timer = timer
        self._lock = threading.Lock()
        self.expirations = 0

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    @property
    def evictions(self) -> int:
        return self._lru.evictions

    def get(self, key: str) -> bytes | None:
        with self._lock:
            item = self._lru.get(key)
            if item is None:
                return None
            value, expires_at = item
            if expires_at is not None and self._timer() >= expires_at:
                self._lru.pop(key)
                self.expirations += 1
                return None
            return value

    def put(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        now = self._timer()
        ttl = self.ttl_seconds if ttl_seconds is None else ttl_seconds
        expires_at = None if ttl is None else now + ttl
        with self._lock:
            self._sweep(now)
            if self._lru.put(key, (bytes(value), expires_at), entry_size(key, value)) is None:
                self._lru.pop(key)  # too large to keep: the old value is stale all the same

    def _sweep(self, now: float) -> None:
        """Drop expired entries from the least recently used end (under the lock).

        An expired entry nobody reads again would otherwise stay until the byte bound evicts
        it: the memory tier in front of Redis (10 s TTL) filled its whole 256 MiB that way,
        the soak's late RSS growth. The oldest entry was last touched before every other one,
        so with one TTL for all (the tier's) everything not touched within the TTL is gone
        after each put; each entry is dropped once, so a put pays O(1) amortized."""
        while (oldest := self._lru.oldest()) is not None:
            key, (_, expires_at) = oldest
            if expires_at is None or now < expires_at:
                return
            self._lru.pop(key)
            self.expirations += 1

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._lru.pop(key) is not None

    def purge(self, pattern: str) -> int:
        match = re.compile(fnmatch.translate(pattern)).match
        with self._lock:
            return len(self._lru.pop_where(lambda key, _: bool(match(key))))

    def scan(self, pattern: str) -> Iterator[tuple[str, int]]:
        match = re.compile(fnmatch.translate(pattern)).match
        with self._lock:
            items = [(key, len(value)) for key, (value, _) in self._lru.items() if match(key)]
        yield from items

    def keys(self) -> list[str]:
        """Live keys, oldest first (for admin listings and tests)."""
        with self._lock:
            return list(self._lru)

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> StoreStats:
        with self._lock:
            memory = MemoryStats(entries=len(self._lru), bytes=self._lru.nbytes,
                                 max_bytes=self._lru.max_bytes, evictions=self._lru.evictions,
                                 expirations=self.expirations)
        return StoreStats("memory", memory=memory)

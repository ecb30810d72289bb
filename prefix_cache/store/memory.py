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
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from .base import Store

# Per-entry bookkeeping (dict slot, tuple, str and bytes headers), so a store of tiny values is
# still bounded by something close to the memory it really takes.
ENTRY_OVERHEAD_BYTES = 160
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class MemoryStore(Store):
    """LRU over ``max_bytes`` (and ``max_entries`` if set); entries expire after ``ttl_seconds``."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_entries: int | None = None,
        ttl_seconds: float | None = None,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if max_entries is not None and max_entries <= 0:
            raise ValueError(f"max_entries must be positive or None, got {max_entries}")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive or None, got {ttl_seconds}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self._timer = timer
        self._lock = threading.Lock()
        self._data: OrderedDict[str, tuple[bytes, float | None]] = OrderedDict()
        self._bytes = 0
        self.evictions = 0
        self.expirations = 0

    @staticmethod
    def _size(key: str, value: bytes) -> int:
        return len(key) + len(value) + ENTRY_OVERHEAD_BYTES

    def _drop(self, key: str) -> None:
        value, _ = self._data.pop(key)
        self._bytes -= self._size(key, value)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                return None
            value, expires_at = item
            if expires_at is not None and self._timer() >= expires_at:
                self._drop(key)
                self.expirations += 1
                return None
            self._data.move_to_end(key)
            return value

    def put(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        size = self._size(key, value)
        ttl = self.ttl_seconds if ttl_seconds is None else ttl_seconds
        expires_at = None if ttl is None else self._timer() + ttl
        with self._lock:
            if key in self._data:
                self._drop(key)
            if size > self.max_bytes:
                return  # larger than the whole store: caching it would evict everything for nothing
            self._data[key] = (bytes(value), expires_at)
            self._bytes += size
            while self._bytes > self.max_bytes or (
                self.max_entries is not None and len(self._data) > self.max_entries
            ):
                oldest = next(iter(self._data))
                self._drop(oldest)
                self.evictions += 1

    def delete(self, key: str) -> bool:
        with self._lock:
            if key not in self._data:
                return False
            self._drop(key)
            return True

    def purge(self, pattern: str) -> int:
        match = re.compile(fnmatch.translate(pattern)).match
        with self._lock:
            doomed = [key for key in self._data if match(key)]
            for key in doomed:
                self._drop(key)
        return len(doomed)

    def scan(self, pattern: str) -> Iterator[tuple[str, int]]:
        match = re.compile(fnmatch.translate(pattern)).match
        with self._lock:
            items = [(key, len(value)) for key, (value, _) in self._data.items() if match(key)]
        yield from items

    def keys(self) -> list[str]:
        """Live keys, oldest first (for admin listings and tests)."""
        with self._lock:
            return list(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "backend": "memory",
                "entries": len(self._data),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "evictions": self.evictions,
                "expirations": self.expirations,
            }

"""The memory store: the contract, plus its own bounds (bytes, entries) and LRU order."""

from __future__ import annotations

from typing import Any

import pytest

from prefix_cache.store import MemoryStore
from prefix_cache.store.memory import ENTRY_OVERHEAD_BYTES

from .contract import StoreContract


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TestMemoryStore(StoreContract):
    def make_store(self, **options: Any) -> MemoryStore:
        self.clock = FakeClock()
        return MemoryStore(timer=self.clock, **options)

    def tick(self, store: Any, seconds: float) -> None:
        self.clock.now += seconds

    def test_lru_bounded_in_bytes(self) -> None:
        size = 100 + len("k0") + ENTRY_OVERHEAD_BYTES
        store = self.make_store(max_bytes=3 * size)
        for i in range(3):
            store.put(f"k{i}", b"x" * 100)
        store.get("k0")  # k0 becomes most recent: k1 is the oldest now
        store.put("k3", b"x" * 100)
        assert store.get("k1") is None
        assert [store.get(k) is not None for k in ("k0", "k2", "k3")] == [True] * 3
        assert store.stats().memory.evictions == 1 and store.stats().memory.bytes <= 3 * size

    def test_bounded_in_entries(self) -> None:
        store = self.make_store(max_entries=2)
        for i in range(5):
            store.put(f"k{i}", b"v")
        assert len(store) == 2 and store.keys() == ["k3", "k4"]

    def test_value_larger_than_store_is_not_kept(self) -> None:
        store = self.make_store(max_bytes=1000)
        store.put("small", b"v")
        store.put("huge", b"x" * 5000)
        assert store.get("huge") is None and store.get("small") == b"v"

    def test_default_ttl(self) -> None:
        store = self.make_store(ttl_seconds=10)
        store.put("k", b"v")
        self.tick(store, 9.9)
        assert store.get("k") == b"v"
        self.tick(store, 0.2)
        assert store.get("k") is None and store.stats().memory.expirations == 1

    def test_expired_entries_nobody_reads_are_dropped_by_later_puts(self) -> None:
        # The tier in front of Redis: a 10 s TTL and far more room than the live entries need.
        # Entries never read again must not stay until the byte bound evicts them.
        store = self.make_store(ttl_seconds=10)
        for i in range(1000):
            store.put(f"old{i}", b"v" * 100)
        self.tick(store, 5)
        store.put("recent", b"v")
        self.tick(store, 5.5)
        store.put("new", b"v")
        assert store.keys() == ["recent", "new"] and store.stats().memory.expirations == 1000
        self.tick(store, 5)
        store.put("newer", b"v")
        assert store.keys() == ["new", "newer"]
        assert store.stats().memory.bytes == 3 + 5 + 2 * (1 + ENTRY_OVERHEAD_BYTES)

    @pytest.mark.parametrize("options", [{"max_bytes": 0}, {"max_entries": 0}, {"ttl_seconds": -1}])
    def test_bad_settings_name_the_value(self, options: dict[str, Any]) -> None:
        with pytest.raises(ValueError, match=next(iter(options))):
            MemoryStore(**options)

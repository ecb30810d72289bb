"""The one byte-bounded LRU (memory store, tenant quotas, engine KV stores)."""

from __future__ import annotations

import pytest

from prefix_cache.util.lru import ByteLRU


def test_evicts_least_recently_used_until_within_bytes() -> None:
    lru: ByteLRU[str, int] = ByteLRU(max_bytes=30)
    for i, key in enumerate("abc"):
        assert lru.put(key, i, 10) == []
    assert lru.get("a") == 0                      # a is the most recent now: b goes first
    assert lru.peek("b") == 1                     # a peek does not refresh
    assert lru.put("d", 3, 15) == [("b", 1), ("c", 2)]
    assert list(lru) == ["a", "d"] and lru.nbytes == 25 and lru.evictions == 2


def test_bounded_in_entries_too() -> None:
    lru: ByteLRU[str, None] = ByteLRU(max_bytes=1000, max_entries=2)
    for key in "abc":
        lru.put(key, None, 1)
    assert list(lru) == ["b", "c"] and len(lru) == 2


def test_a_value_larger_than_the_whole_map_changes_nothing() -> None:
    lru: ByteLRU[str, str] = ByteLRU(max_bytes=10)
    lru.put("k", "old", 4)
    assert lru.put("k", "huge", 11) is None
    assert lru.peek("k") == "old" and lru.nbytes == 4


def test_replacing_a_key_counts_its_new_size_once() -> None:
    lru: ByteLRU[str, str] = ByteLRU(max_bytes=10)
    lru.put("k", "a", 4)
    lru.put("k", "b", 6)
    assert lru.nbytes == 6 and len(lru) == 1 and lru.evictions == 0


def test_pop_and_pop_where() -> None:
    lru: ByteLRU[str, int] = ByteLRU(max_bytes=100)
    for i in range(5):
        lru.put(f"k{i}", i, 10)
    assert lru.pop("k0") == 0 and lru.pop("k0") is None
    assert lru.pop_where(lambda _, v: v % 2 == 1) == [("k1", 1), ("k3", 3)]
    assert list(lru.items()) == [("k2", 2), ("k4", 4)] and lru.nbytes == 20


@pytest.mark.parametrize("options", [{"max_bytes": 0}, {"max_bytes": 1, "max_entries": 0}])
def test_bad_bounds_name_the_value(options: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=list(options)[-1]):
        ByteLRU(**options)

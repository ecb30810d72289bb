"""The store contract, written once: every backend's test class inherits it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from prefix_cache.store import Store


class StoreContract:
    """Subclasses provide ``make_store(**options)`` and, if they can, ``tick(seconds)``."""

    def make_store(self, **options: Any) -> Store:
        raise NotImplementedError

    def tick(self, store: Store, seconds: float) -> None:
        pytest.skip("this backend's clock cannot be moved")

    def test_get_missing_is_none(self) -> None:
        assert self.make_store().get("spc:ns:m:absent") is None

    def test_put_then_get(self) -> None:
        store = self.make_store()
        store.put("spc:ns:m:a", b"\x00\x01value")
        assert store.get("spc:ns:m:a") == b"\x00\x01value"

    def test_put_overwrites(self) -> None:
        store = self.make_store()
        store.put("spc:ns:m:a", b"one")
        store.put("spc:ns:m:a", b"two")
        assert store.get("spc:ns:m:a") == b"two"

    def test_delete(self) -> None:
        store = self.make_store()
        store.put("spc:ns:m:a", b"v")
        assert store.delete("spc:ns:m:a") is True
        assert store.get("spc:ns:m:a") is None
        assert store.delete("spc:ns:m:a") is False

    def test_purge_by_namespace_and_model(self) -> None:
        store = self.make_store()
        for ns in ("t1", "t2"):
            for model in ("ma", "mb"):
                for i in range(3):
                    store.put(f"spc:{ns}:{model}:{i}", b"v")
        assert store.purge("spc:t1:*:*") == 6
        assert store.get("spc:t1:ma:0") is None and store.get("spc:t2:ma:0") == b"v"
        assert store.purge("spc:*:mb:*") == 3
        assert store.get("spc:t2:mb:1") is None and store.get("spc:t2:ma:1") == b"v"
        assert store.purge("spc:nobody:*:*") == 0

    def test_ttl_expires(self) -> None:
        store = self.make_store()
        store.put("spc:ns:m:short", b"v", ttl_seconds=0.2)
        store.put("spc:ns:m:long", b"v", ttl_seconds=100.0)
        self.tick(store, 0.4)
        assert store.get("spc:ns:m:short") is None
        assert store.get("spc:ns:m:long") == b"v"

    def test_async_forms(self) -> None:
        store = self.make_store()

        async def go() -> tuple[Any, ...]:
            store.put("spc:ns:m:x", b"async")
            got = await store.aget("spc:ns:m:x")
            deleted = store.delete("spc:ns:m:x")
            store.put("spc:ns:m:y", b"1")
            store.put("spc:ns:m:z", b"2")
            adeleted = (await store.adelete("spc:ns:m:z"), await store.adelete("spc:ns:m:z"))
            purged = await store.apurge("spc:ns:*:*")
            answers = (store.ping(), await store.aping())
            await store.aclose()
            return got, deleted, adeleted, purged, answers

        assert asyncio.run(go()) == (b"async", True, (True, False), 1, (True, True))

    def test_async_purge_of_many_keys(self) -> None:
        store = self.make_store()
        for i in range(1200):  # more than one SCAN page and one delete batch
            store.put(f"spc:many:m:{i}", b"v")
        store.put("spc:other:m:0", b"v")
        assert asyncio.run(store.apurge("spc:many:*:*")) == 1200
        assert store.get("spc:many:m:7") is None and store.get("spc:other:m:0") == b"v"

    def test_concurrent_threads(self) -> None:
        store = self.make_store()

        def work(t: int) -> None:
            for i in range(50):
                store.put(f"spc:ns:m:{t}-{i}", bytes([t, i]))
                assert store.get(f"spc:ns:m:{t}-{i}") == bytes([t, i])

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert all(store.get(f"spc:ns:m:{t}-49") == bytes([t, 49]) for t in range(4))

    def test_scan_lists_keys_with_sizes(self) -> None:
        store = self.make_store()
        store.put("spc:t1:m:a", b"12345")
        store.put("spc:t1:m:b", b"1")
        store.put("spc:t2:m:c", b"123")
        assert sorted(store.scan("spc:t1:*:*")) == [("spc:t1:m:a", 5), ("spc:t1:m:b", 1)]

    def test_binary_values_kept_exactly(self) -> None:
        store = self.make_store()
        value = bytes(range(256)) * 64
        store.put("spc:ns:m:bin", value)
        assert store.get("spc:ns:m:bin") == value

"""The store contract on a real Redis, on memory-over-Redis, and on a real 3-master cluster."""

from __future__ import annotations

import time
from typing import Any

import pytest

from prefix_cache.store import MemoryStore
from prefix_cache.store.factory import open_store
from prefix_cache.store.redis import RedisStore
from prefix_cache.store.tiered import TieredStore

from .contract import StoreContract
from tests.support.redis_server import RedisCluster, RedisServer, needs_redis

pytestmark = needs_redis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()


class TestRedisStore(StoreContract):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server
        redis_server.cli("flushall")

    def make_store(self, **options: Any) -> RedisStore:
        return RedisStore(self.server.url, timeout_seconds=1.0, **options)

    def tick(self, store: Any, seconds: float) -> None:
        time.sleep(seconds)

    def test_default_ttl_is_set_in_redis(self) -> None:
        store = self.make_store(ttl_seconds=100)
        store.put("spc:ns:m:t", b"v")
        assert 0 < int(self.server.cli("pttl", "spc:ns:m:t")) <= 100_000

    def test_purge_uses_scan_over_many_keys(self) -> None:
        store = self.make_store()
        client = self.server.client()
        client.mset({f"spc:t:m:{i}": b"v" for i in range(2500)})
        client.set("other:t:m:1", b"v")
        assert store.purge("spc:t:*:*") == 2500
        assert client.dbsize() == 1


class TestTieredStore(StoreContract):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server
        redis_server.cli("flushall")

    def make_store(self, **options: Any) -> TieredStore:
        return TieredStore(MemoryStore(), RedisStore(self.server.url, timeout_seconds=1.0), **options)

    def tick(self, store: Any, seconds: float) -> None:
        time.sleep(seconds)

    def test_redis_hit_fills_memory(self) -> None:
        writer, reader = self.make_store(), self.make_store()
        writer.put("spc:ns:m:k", b"shared")
        assert reader.local.get("spc:ns:m:k") is None
        assert reader.get("spc:ns:m:k") == b"shared"
        calls = reader.remote.calls
        assert reader.get("spc:ns:m:k") == b"shared" and reader.remote.calls == calls  # from memory

    def test_purge_elsewhere_is_seen_after_local_ttl(self) -> None:
        a = self.make_store(local_ttl_seconds=0.2)
        b = self.make_store()
        a.put("spc:t1:m:k", b"v")
        assert a.get("spc:t1:m:k") == b"v"
        assert b.purge("spc:t1:*:*") >= 1
        time.sleep(0.3)
        assert a.get("spc:t1:m:k") is None


class TestClusterStore(StoreContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster: RedisCluster) -> None:
        self.cluster = redis_cluster
        for node in redis_cluster.nodes:
            node.cli("flushall")

    def make_store(self, **options: Any) -> RedisStore:
        return RedisStore(self.cluster.url.replace("redis+cluster", "redis"), cluster=True,
                          timeout_seconds=1.0, **options)

    def tick(self, store: Any, seconds: float) -> None:
        time.sleep(seconds)

    def test_keys_spread_over_all_masters(self) -> None:
        store = self.make_store()
        for i in range(60):
            store.put(f"spc:ns:m:{i}", b"v")
        assert all(int(node.cli("dbsize")) > 0 for node in self.cluster.nodes)
        assert store.purge("spc:ns:*:*") == 60

    async def test_warming_leaves_a_cluster_to_its_own_pools(self) -> None:
        store = self.make_store()
        assert await store.awarm(8) == 0 and store.warm(8) == 0  # nothing opened, no error
        store.put("spc:ns:m:w", b"v")
        assert await store.aget("spc:ns:m:w") == b"v"


@pytest.mark.parametrize("url,backend", [
    (None, "memory"), ("memory://", "memory"),
])
def test_factory_memory(url, backend) -> None:
    assert open_store(url).stats().backend == backend


def test_factory_redis_urls(redis_server, redis_cluster) -> None:
    tiered = open_store(redis_server.url)
    assert isinstance(tiered, TieredStore) and not tiered.remote.cluster
    cluster = open_store(redis_cluster.url)
    assert isinstance(cluster, TieredStore) and cluster.remote.cluster
    cluster.put("spc:a:b:c", b"v")
    assert open_store(redis_cluster.url).get("spc:a:b:c") == b"v"
    plain = open_store(redis_server.url + "?cluster=0", tiered=False)
    assert isinstance(plain, RedisStore)


@pytest.mark.parametrize("url", ["http://x", "mongodb://y"])
def test_factory_refuses_unknown_scheme(url) -> None:
    with pytest.raises(ValueError, match="scheme"):
        open_store(url)


def test_password_is_redacted_in_stats() -> None:
    store = RedisStore("redis://user:secret@127.0.0.1:1/0")
    assert "secret" not in str(store.stats())

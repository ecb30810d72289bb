"""The stores under pressure and outages, on a real redis-server: a full connection pool is not an
outage, purges never block the event loop and are all or nothing, the tenant books never lose a
stored key."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefix_cache.errors import StoreUnavailableError
from prefix_cache.store.breaker import CLOSED, OPEN, CircuitBreaker, ExponentialBackoff
from prefix_cache.store.memory import MemoryStore
from prefix_cache.store.quota import TenantQuotaStore
from prefix_cache.store.redis import RedisStore
from prefix_cache.store.tiered import TieredStore

from tests.support.clock import Clock
from tests.support.redis_server import RedisServer, needs_redis
from tests.support.store_keys import key

pytestmark = needs_redis
# Timeouts here are generous: the machine running the tests may be busy, and no assertion is
# about how fast anything is.
SLOW_OK_S = 2.0
# Answers in the burst test: the service's 50 ms times a margin for a test machine at a load
# average of 20 (where even answers from a healthy server wait that long for a core); its
# set-up gets SLOW_OK_S. At a load average of 22 even that ran out once in 20 starts.
BURST_ANSWER_S = 0.25


def redis_keys(redis: RedisServer, ns: str) -> set[str]:
    return set(redis.cli("--scan", "--pattern", f"spc:{ns}:*").split())


# -- 1. a full pool is a busy server, not a dead one ------------------------------------------------


async def test_more_concurrent_reads_than_connections_wait_and_all_hit(redis) -> None:
    store = RedisStore(redis.url, max_connections=4, timeout_seconds=SLOW_OK_S)
    for i in range(100):
        store.put(key("t", i), b"v%d" % i)
    values = await asyncio.gather(*(store.aget(key("t", i)) for i in range(100)),
                                  return_exceptions=True)
    assert values == [b"v%d" % i for i in range(100)]     # 100 hits, no recompute
    assert store.breaker.times_opened == 0 and store.errors == 0 and store.busy == 0


def test_more_threads_than_connections_wait_and_all_hit(redis) -> None:
    store = RedisStore(redis.url, max_connections=2, timeout_seconds=SLOW_OK_S)
    for i in range(64):
        store.put(key("t", i), b"v%d" % i)
    def get(i: int) -> bytes | None | Exception:
        try:
            return store.get(key("t", i))
        except StoreUnavailableError as exc:
            return exc

    with ThreadPoolExecutor(16) as pool:
        values = list(pool.map(get, range(64)))
    assert values == [b"v%d" % i for i in range(64)]
    assert store.breaker.times_opened == 0 and store.errors == 0


async def test_a_wait_that_runs_out_is_busy_not_an_outage(redis) -> None:
    from prefix_cache.errors import StoreBusyError

    store = RedisStore(redis.url, max_connections=1, timeout_seconds=SLOW_OK_S,
                       pool_wait_seconds=0.05)
    assert await store.aget(key("t", 1)) is None  # the one connection is open
    # One call holds the only connection (the server, stopped, has not answered it yet)...
    redis.pause()
    try:
        holder = asyncio.ensure_future(store.aget(key("t", 0)))
        while store.holding == 0:
            await asyncio.sleep(0.005)
        # ...so the next one gives up after its wait: a recompute for that caller, nothing more.
        with pytest.raises(StoreBusyError):
            await store.aget(key("t", 1))
        assert await store.aping()      # busy is not down: the breaker's closed state is trusted
    finally:
        redis.resume()
    assert await holder is None         # the server answers the held call once it runs again
    assert store.breaker.state == CLOSED and store.breaker.times_opened == 0
    assert store.busy >= 1 and store.errors == 0
    assert store.stats().remote.busy == store.busy
    assert await store.aget(key("t", 1)) is None  # and the store serves again at once


@pytest.mark.parametrize("start", range(10))
async def test_a_burst_on_a_cold_pool_of_a_healthy_server_is_all_hits(redis, start: int) -> None:
    # A fresh client, nothing connected yet, 128 concurrent reads: each of the 32 connections
    # is set up inside the burst, under the set-up timeout, not the answers'; none of it is an
    # outage. (On main, with the service's 50 ms for set-up and answers alike, beside other
    # builds on two cores: 7 of 10 starts had a connect or handshake run out, the breaker open
    # and the rest of the burst computed. The service's own figures: bench/redis_burst.py.)
    writer = RedisStore(redis.url, timeout_seconds=SLOW_OK_S)
    for i in range(128):
        writer.put(key("t", i), b"v%d" % i)
    store = RedisStore(redis.url, timeout_seconds=BURST_ANSWER_S, connect_timeout_seconds=SLOW_OK_S)
    values = await asyncio.gather(*(store.aget(key("t", i)) for i in range(128)),
                                  return_exceptions=True)
    assert values == [b"v%d" % i for i in range(128)]     # 128 hits
    assert store.breaker.times_opened == 0 and store.errors == 0 and store.busy == 0


def test_setting_up_a_connection_has_its_own_longer_timeout() -> None:
    store = RedisStore("redis://127.0.0.1:1/0")
    assert store.timeout_seconds == 0.05 and store.connect_timeout_seconds == 1.0
    assert store.client_options["socket_connect_timeout"] == 1.0 == store.pool_wait_seconds
    assert RedisStore("redis://127.0.0.1:1/0", timeout_seconds=3).connect_timeout_seconds == 3


async def test_the_pools_are_warmed_ahead_of_a_burst_and_again_after_errors(redis) -> None:
    store = RedisStore(redis.url, max_connections=8)
    assert await store.awarm(8) == 16               # the loop's client and the sync one
    assert clients(redis) == 16
    assert await store.awarm(8) == 0                # nothing failed since: nothing to do
    redis.cli("client", "kill", "type", "normal")   # every connection dropped by the server
    with pytest.raises(StoreUnavailableError):
        await store.aget(key("t", 0))               # a failure: the breaker opens
    assert await store.awarm(8) == 0                # an outage is the probes' business
    store.breaker.record_success()
    assert await store.awarm(8) == 16 and clients(redis) == 16


async def test_a_server_that_never_answers_a_connect_still_opens_the_breaker(redis) -> None:
    # Hung (SIGSTOP): the kernel still accepts the TCP connection, the handshake gets no answer.
    store = RedisStore(redis.url, connect_timeout_seconds=0.3)
    redis.pause()
    try:
        started = time.perf_counter()
        results = await asyncio.gather(*(store.aget(key("t", i)) for i in range(20)),
                                       return_exceptions=True)
        elapsed = time.perf_counter() - started
    finally:
        redis.resume()
    assert all(isinstance(r, StoreUnavailableError) for r in results)
    assert store.breaker.state == OPEN and store.breaker.times_opened == 1
    assert elapsed < 0.3 + SLOW_OK_S    # one set-up timeout (then the breaker), not 20 of them


def clients(redis: RedisServer) -> int:
    """Connections the server has from clients, redis-cli's own not counted."""
    return len(redis.cli("client", "list").splitlines()) - 1


def test_gate_bounds_holders_and_refuses_after_the_wait() -> None:
    from prefix_cache.errors import StoreBusyError
    from prefix_cache.store.gate import ConnectionGate

    gate = ConnectionGate(1, 0.01)
    with gate.hold():
        with pytest.raises(StoreBusyError, match="1 store connections"), gate.hold():
            pass
    with gate.hold():  # released, also after the refusal
        pass
    assert gate.busy == 1
    with pytest.raises(ValueError):
        ConnectionGate(0, 1.0)


async def test_a_dead_server_still_opens_the_breaker(tmp_path) -> None:
    from prefix_cache.errors import StoreBusyError

    from tests.support.loopback import free_port

    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", max_connections=2)
    with pytest.raises(StoreUnavailableError) as failure:
        await store.aget(key("t", 0))
    assert not isinstance(failure.value, StoreBusyError)
    assert store.breaker.state == OPEN and not await store.aping()


# -- 11c. a purge in an outage changes nothing --------------------------------------------------


async def test_a_purge_refused_by_an_outage_leaves_memory_as_it_was(redis) -> None:
    clock = Clock()
    remote = RedisStore(redis.url, breaker=CircuitBreaker(ExponentialBackoff(1.0, 1.0), timer=clock))
    store = TieredStore(MemoryStore(), remote)
    for i in range(3):
        store.put(key("acme", i), b"v")
    redis.pause()
    try:
        with pytest.raises(StoreUnavailableError):
            await store.apurge("spc:acme:*:*")
        assert len(store.local) == 3
        with pytest.raises(StoreUnavailableError):
            store.delete(key("acme", 0))
        assert len(store.local) == 3
    finally:
        redis.resume()
    assert len(redis_keys(redis, "acme")) == 3
    clock.now += 1.0
    assert await store.apurge("spc:acme:*:*") == 3
    assert len(store.local) == 0 and redis_keys(redis, "acme") == set()


# -- 12. the tenant books never lose a stored key ----------------------------------------------


@pytest.mark.parametrize("fault", ["hung", "killed"])
def test_quota_books_hold_every_stored_key_through_an_outage(redis, fault) -> None:
    clock = Clock()
    remote = RedisStore(redis.url, breaker=CircuitBreaker(ExponentialBackoff(1.0, 1.0), timer=clock))
    store = TenantQuotaStore(TieredStore(MemoryStore(), remote), max_entries=5, max_bytes=1 << 20)
    for i in range(5):
        store.put(key("acme", i), b"v")
    if fault == "hung":
        redis.pause()
    else:  # killed, and back with its data: the redis-server restarts from a dump
        redis.cli("save")
        redis.kill()
    try:
        for i in range(5, 9):  # evictions whose deletes cannot reach Redis
            with pytest.raises(StoreUnavailableError):
                store.put(key("acme", i), b"v")
    finally:
        if fault == "hung":
            redis.resume()
        else:
            redis.start()
    clock.now += 1.0
    for i in range(9, 12):
        store.put(key("acme", i), b"v")
    stored = redis_keys(redis, "acme")
    assert len(stored) <= 5                                   # the quota held
    assert store.tenant_usage()["acme"]["entries"] == len(stored)
    assert store.pending_deletes() == {}
    assert {key("acme", i) for i in range(9, 12)} <= stored   # the newest are the ones kept

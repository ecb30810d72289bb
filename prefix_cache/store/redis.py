"""Redis (and Redis Cluster) store on redis-py: the shared tier across workers and replicas.

Values are the core's binary entries, stored as-is under the cache's namespaced keys, with a TTL.
Timeouts default to tens of milliseconds and client retries are off: a slow or dead Redis must
cost a bounded delay and then a recompute, never a stall. Every redis-py and socket error is
converted to ``StoreUnavailableError`` in one place (``_guard``), and a circuit breaker stops
calls while the server is known to be down, so a dead Redis costs one timeout per probe window,
not one per request. It reconnects by itself: the half-open probe is an ordinary call.

Setting a connection up (TCP connect and redis-py's handshake) has its own, longer timeout than a
call's answer: a burst of new connections to a healthy server queues on busy local cores, and a
slow set-up is contention, not an outage (a dead server still refuses or times out, once per
probe window). The pools are also opened ahead of the traffic (``awarm``: at start, and again
once errors have dropped connections and the breaker is closed), so a burst finds them made.

The sync client serves ``get``/``put``/``delete`` (used from render threads and sync callers),
the asyncio client serves ``aget``/``adelete``/``apurge``/``aping`` (what runs on the event loop:
a request's lookup, an admin purge of any size, readiness), so nothing here blocks a loop. Both
share one breaker, since both talk to the same server. Each client has its ``ConnectionGate``:
more concurrent calls than connections wait briefly for one instead of failing, and a wait that
runs out costs that call a recompute without opening the breaker (only an outage does).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AsyncExitStack, ExitStack
from itertools import islice
from types import MappingProxyType
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

from ..errors import StoreBusyError, StoreUnavailableError
from .base import RemoteStats, Store, StoreStats
from .breaker import CLOSED, OPEN, CircuitBreaker, ExponentialBackoff
from .gate import ConnectionGate
from .steps import Steps, arun, run, twins

T = TypeVar("T")

DEFAULT_TIMEOUT_SECONDS = 0.05
DEFAULT_CONNECT_TIMEOUT_SECONDS = 1.0
DEFAULT_TTL_SECONDS = 7 * 24 * 3600.0
DEFAULT_MAX_CONNECTIONS = 32
SCAN_COUNT = 1000
DELETE_BATCH = 500


# KEYS: the key, the guard; ARGV: the value, its TTL in ms (0: none), the guard's expected value.
_PUT_IF_EQUAL = """
if (redis.call('GET', KEYS[2]) or '') ~= ARGV[3] then return 0 end
if tonumber(ARGV[2]) > 0 then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""


def _is_outage(exc: BaseException) -> bool:
    """Connection loss and timeouts mean the server is unreachable; an error reply does not, and
    neither does a client out of connections (a Redis Cluster node's pool: the gate bounds the
    total, not each node's share)."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import MaxConnectionsError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, MaxConnectionsError):
        return False
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError))


class RedisStore(Store):
    """A store on one Redis server or a Redis Cluster (``cluster=True``)."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        cluster: bool = False,
        ttl_seconds: float | None = DEFAULT_TTL_SECONDS,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        connect_timeout_seconds: float | None = DEFAULT_CONNECT_TIMEOUT_SECONDS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_wait_seconds: float | None = None,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive or None, got {ttl_seconds}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if pool_wait_seconds is not None and pool_wait_seconds <= 0:
            raise ValueError(f"pool_wait_seconds must be positive or None, got {pool_wait_seconds}")
        if connect_timeout_seconds is not None and connect_timeout_seconds <= 0:
            raise ValueError("connect_timeout_seconds must be positive or None, got "
                             f"{connect_timeout_seconds}")
        # Never shorter than an answer may take: a set-up includes a round trip.
        connect = max(timeout_seconds, connect_timeout_seconds or DEFAULT_CONNECT_TIMEOUT_SECONDS)
        self.url = url
        self.cluster = cluster
        self.ttl_seconds = ttl_seconds
        self.breaker = breaker or CircuitBreaker(ExponentialBackoff(0.5, 30.0))
        self._options: dict[str, Any] = {
            "socket_timeout": timeout_seconds,
            "socket_connect_timeout": connect,
            "max_connections": max_connections,
        }
        self.timeout_seconds = timeout_seconds
        self.connect_timeout_seconds = connect
        # A call waits for a connection at most as long as one may take to set up (in a cold
        # pool the holders ahead of it are connecting); a busy warm pool frees one much sooner.
        self.pool_wait_seconds = pool_wait_seconds or connect
        self._sync: Any = None
        self._gate = ConnectionGate(max_connections, self.pool_wait_seconds)
        # One asyncio client (and its gate) per event loop: a client's connections belong to
        # the loop they were made on.
        self._async: weakref.WeakKeyDictionary[Any, tuple[Any, ConnectionGate]] = \
            weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.calls = 0          # calls that reached the network (for tests and stats)
        self.errors = 0
        self.skipped = 0        # calls refused by the open breaker
        self._warm_errors: int | None = None  # ``errors`` at the last warm-up

    # -- clients ---------------------------------------------------------------------------

    def _client(self) -> Any:
        if self._sync is None:
            with self._lock:
                if self._sync is None:
                    self._sync = self._make_client(asyncio_client=False)
        return self._sync

    def _aclient(self) -> tuple[Any, ConnectionGate]:
        loop = asyncio.get_running_loop()
        pair = self._async.get(loop)
        if pair is None:
            gate = ConnectionGate(int(self._options["max_connections"]), self.pool_wait_seconds)
            pair = self._async[loop] = (self._make_client(asyncio_client=True), gate)
        return pair

    @property
    def client_options(self) -> Mapping[str, Any]:
        """The options every client of this store is made with (read-only)."""
        return MappingProxyType(self._options)

    @property
    def holding(self) -> int:
        """Calls holding one of this store's connections now, all clients together."""
        return self._gate.holding + sum(gate.holding for _, gate in list(self._async.values()))

    @property
    def busy(self) -> int:
        """Calls that found every connection busy for the whole wait (no breaker involved)."""
        return self._gate.busy + sum(gate.busy for _, gate in list(self._async.values()))

    def _make_client(self, asyncio_client: bool) -> Any:
        from redis.backoff import NoBackoff

        if asyncio_client:
            from redis.asyncio import Redis
            from redis.asyncio.cluster import RedisCluster
            from redis.asyncio.retry import Retry
        else:
            from redis import Redis  # type: ignore[assignment]
            from redis.cluster import RedisCluster  # type: ignore[assignment]
            from redis.retry import Retry  # type: ignore[assignment]
        no_retry = Retry(NoBackoff(), 0)  # the breaker and the recompute are our retry
        if self.cluster:  # the cluster clients set up their connections themselves
            return RedisCluster.from_url(self.url, retry=no_retry, cluster_error_retry_attempts=1,
                                         **self._options)
        set_up = _aset_up if asyncio_client else _set_up
        return Redis.from_url(self.url, retry=no_retry, redis_connect_func=set_up, **self._options)

    # -- the one place errors are converted ----------------------------------------------------

    def _admit(self) -> None:
        if not self.breaker.allow():
            self.skipped += 1
            raise StoreUnavailableError("redis circuit open: skipping the store")
        self.calls += 1

    def _failed(self, exc: BaseException) -> StoreUnavailableError:
        self.errors += 1
        if _is_outage(exc):
            self.breaker.record_failure()
        else:
            self.breaker.record_success()  # the server answered; it is up, just refusing
        return StoreUnavailableError(f"redis: {type(exc).__name__}: {exc}")

    # A connection first, then the breaker: a half-open probe must not be claimed by a caller
    # that then gives up waiting for a connection.
    def _call(self, fn: Callable[[Any], T]) -> T:
        with self._gate.hold():
            self._admit()
            try:
                result = fn(self._client())
            except Exception as exc:
                raise self._failed(exc) from exc
        self.breaker.record_success()
        return result

    async def _acall(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        client, gate = self._aclient()
        async with gate.ahold():
            self._admit()
            try:
                result = await fn(client)
            except Exception as exc:
                raise self._failed(exc) from exc
        self.breaker.record_success()
        return result

    # -- probes and warm pools: written once as steps (steps.py) on the I/O below -------------
    # The I/O, sync and async: ``_probe`` calls ``fn`` on a client through its gate, the breaker
    # neither asked nor moved; ``_hold`` takes a connection through the gate and keeps it (and
    # its gate slot) until ``stack`` closes.

    def _probe(self, fn: Callable[[Any], T]) -> T:
        with self._gate.hold():
            return fn(self._client())

    async def _aprobe(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        client, gate = self._aclient()
        async with gate.ahold():
            return await fn(client)

    def _hold(self, stack: ExitStack) -> None:
        stack.enter_context(self._gate.hold())
        pool = self._client().connection_pool
        stack.callback(pool.release, pool.get_connection())

    async def _ahold(self, stack: AsyncExitStack) -> None:
        client, gate = self._aclient()
        await stack.enter_async_context(gate.ahold())
        pool = client.connection_pool
        stack.push_async_callback(pool.release, await pool.get_connection())

    def _warm(self, connections: int, stack: ExitStack | AsyncExitStack) -> Steps[int]:
        """Open up to ``connections`` of one client's connections (each taken through the gate,
        all held at once on ``stack`` so each is its own); how many are open. Best effort: a busy
        gate or a failed connect ends it early, and the breaker is not moved."""
        opened = 0
        try:
            while opened < min(connections, self._gate.slots):  # both gates: max_connections
                yield "_hold", (stack,)
                opened += 1
        except Exception:  # noqa: BLE001 - warming is an optimisation; calls report outages
            pass
        return opened

    def warm(self, connections: int) -> int:
        """``_warm`` for the sync client. Redis Cluster's clients keep a pool per node, made as
        they discover the nodes: not warmed here."""
        if self.cluster:
            return 0
        with ExitStack() as stack:
            return run(self, self._warm(connections, stack))

    async def awarm(self, connections: int) -> int:
        """``_warm`` for the running loop's asyncio client, and the sync client's in a thread.
        Skipped (0) while the breaker is not closed (an outage is the probes' business) and
        when no call failed since the last warm-up (a failure is what drops connections)."""
        if (self.cluster or self.breaker.state != CLOSED or connections <= 0
                or self._warm_errors == self.errors):
            return 0
        self._warm_errors = self.errors
        sync = asyncio.ensure_future(asyncio.to_thread(self.warm, connections))
        async with AsyncExitStack() as stack:
            opened = await arun(self, self._warm(connections, stack))
        return opened + await sync

    def _px(self, ttl_seconds: float | None) -> int | None:
        ttl = self.ttl_seconds if ttl_seconds is None else ttl_seconds
        return None if ttl is None else max(1, int(ttl * 1000))

    # -- the store interface -----------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        return self._call(lambda r: r.get(key))

    def put(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        px = self._px(ttl_seconds)
        self._call(lambda r: r.set(key, value, px=px))

    def delete(self, key: str) -> bool:
        return bool(self._call(lambda r: r.delete(key)))

    def purge(self, pattern: str) -> int:
        def run(r: Any) -> int:
            keys = r.scan_iter(match=pattern, count=SCAN_COUNT)  # SCAN, never KEYS
            return sum(int(r.delete(*batch)) for batch in _batches(keys))
        return self._call(run)

    async def apurge(self, pattern: str) -> int:
        """``purge`` on the event loop's client: each SCAN page and each DEL batch is its own
        round trip, so the loop serves other requests between them, however many keys match."""
        async def run(r: Any) -> int:
            keys = r.scan_iter(match=pattern, count=SCAN_COUNT)
            return sum([int(await r.delete(*batch)) async for batch in _abatches(keys)])
        return await self._acall(run)

    def scan(self, pattern: str) -> Iterator[tuple[str, int]]:
        def run(r: Any) -> list[tuple[str, int]]:
            out: list[tuple[str, int]] = []
            for batch in _batches(r.scan_iter(match=pattern, count=SCAN_COUNT)):
                pipe = r.pipeline(transaction=False)
                for key in batch:
                    pipe.strlen(key)
                out.extend((k.decode(errors="replace"), n)
                           for k, n in zip(batch, pipe.execute(), strict=True))
            return out
        return iter(self._call(run))

    async def aget(self, key: str) -> bytes | None:
        return await self._acall(lambda r: r.get(key))

    async def adelete(self, key: str) -> bool:
        return bool(await self._acall(lambda r: r.delete(key)))

    def put_if_equal(self, key: str, value: bytes, ttl_seconds: float | None, guard: str,
                     expected: bytes) -> bool:
        """``put`` only while ``guard`` holds ``expected`` (b"": absent), in one step on the
        server (a script), so a writer that read ``guard`` before another client changed it
        stores nothing after that change. Redis Cluster: ``key`` and ``guard`` must share a
        hash slot (a ``{tag}``). Whether it was stored."""
        px = self._px(ttl_seconds)
        return bool(self._call(lambda r: r.eval(_PUT_IF_EQUAL, 2, key, guard, value,
                                                px or 0, expected)))

    async def aincr(self, key: str) -> int:
        """Add one to the counter under ``key`` (absent: 0) and return it; no TTL."""
        return int(await self._acall(lambda r: r.incr(key)))

    def memory_usage(self, key: str) -> int | None:
        """Bytes Redis spends on one key (MEMORY USAGE), for the benchmark."""
        return self._call(lambda r: r.memory_usage(key))

    # Readiness wants the truth now, so pings ignore the breaker (and never move it).
    def _ping(self) -> Steps[bool]:
        """True if the server answers now; when every connection stayed busy, whether the last
        calls found it up (the breaker not open)."""
        try:
            return bool((yield "_probe", (_ping,)))
        except Exception as exc:  # noqa: BLE001 - any failure is "not answered"
            return isinstance(exc, StoreBusyError) and self.breaker.state != OPEN

    ping, aping = twins(_ping)  # aping on the running loop's client

    def stats(self) -> StoreStats:
        remote = RemoteStats(url=_redact(self.url), breaker=self.breaker.state,
                             breaker_opened=self.breaker.times_opened, calls=self.calls,
                             errors=self.errors, skipped=self.skipped, busy=self.busy)
        return StoreStats("redis-cluster" if self.cluster else "redis", remote=remote)

    async def aclose(self) -> None:
        """Close the running loop's connections (on the loop that made them), then the rest."""
        pair = self._async.pop(asyncio.get_running_loop(), None)
        if pair is not None:
            await pair[0].aclose()
        self.close()

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
        self._async.clear()


def _batches(keys: Iterable[T]) -> Iterator[list[T]]:
    """``keys`` in lists of at most DELETE_BATCH: one DEL or one pipeline each."""
    it = iter(keys)
    while batch := list(islice(it, DELETE_BATCH)):
        yield batch


async def _abatches(keys: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """``_batches`` of an asyncio SCAN, each batch as soon as its keys came."""
    batch: list[T] = []
    async for key in keys:
        batch.append(key)
        if len(batch) == DELETE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _ping(client: Any) -> Any:
    return client.ping()  # a bool, or on the asyncio client its awaitable


def _set_up(connection: Any) -> None:
    """redis-py's handshake on a new sync connection, under the connect timeout."""
    connection._sock.settimeout(connection.socket_connect_timeout)
    try:
        connection.on_connect()
    finally:
        if connection._sock is not None:
            connection._sock.settimeout(connection.socket_timeout)


async def _aset_up(connection: Any) -> None:
    """``_set_up`` for an asyncio connection (its reads take ``socket_timeout`` each time)."""
    answer = connection.socket_timeout
    connection.socket_timeout = connection.socket_connect_timeout
    try:
        await connection.on_connect()
    finally:
        connection.socket_timeout = answer


def _redact(url: str) -> str:
    """The URL without its password, for stats and logs."""
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def open_redis_store(url: str, **options: Any) -> Store:
    """A Redis store from a URL, with a memory tier in front unless ``tiered=False``.

    ``redis+cluster://host:port`` (or ``?cluster=1``) selects Redis Cluster; ``rediss://`` TLS;
    ``unix:///path/redis.sock`` a local socket.
    """
    from .memory import MemoryStore
    from .tiered import TieredStore

    parts = urlsplit(url)
    query = parse_qs(parts.query)
    cluster = parts.scheme.startswith("redis+cluster") or query.get("cluster", ["0"])[0] in ("1", "true")
    if parts.scheme.startswith("redis+cluster"):
        scheme = "rediss" if parts.scheme.endswith("s") else "redis"
        url = urlunsplit(parts._replace(scheme=scheme))
    if "cluster" in query:
        kept = "&".join(f"{k}={v[0]}" for k, v in query.items() if k != "cluster")
        url = urlunsplit(urlsplit(url)._replace(query=kept))
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"unsupported store URL scheme in {_redact(url)!r}: use redis://, "
                         "rediss://, unix:// or redis+cluster://")
    tiered = options.pop("tiered", True)
    local_ttl = options.pop("local_ttl_seconds", None)
    memory_opts = {k: options.pop(k) for k in ("max_bytes", "max_entries") if k in options}
    remote = RedisStore(url, cluster=cluster, **options)
    if not tiered:
        return remote
    return TieredStore(MemoryStore(**memory_opts), remote, local_ttl_seconds=local_ttl)

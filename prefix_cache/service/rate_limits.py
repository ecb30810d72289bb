"""Per-tenant rates: requests and prompt tokens per minute (``tenant_limits`` in the keys file:
``requests_per_minute``, ``tokens_per_minute``), a 429 with ``Retry-After`` when spent.

The count is per fixed minute (the wall clock's, so every process agrees on the window):

- with ``--redis``, in Redis (``INCRBY`` on one key per tenant, kind and minute, expiring after
  two), so the limit holds across workers and replicas; a Redis that fails or is slow past its
  timeout costs nothing but exactness: the worker counts on its own until Redis answers again;
- without it, in each worker (N workers let a tenant through up to N times the limit).

A request is refused once the tenant's minute is spent: a request past ``requests_per_minute``,
or any request once the prompt tokens it was answered already reach ``tokens_per_minute``
(a request's tokens are known only once it is prepared, so the one that crosses the limit
runs; the ones after it wait for the next minute).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from ..http.errors import TooManyRequests

log = logging.getLogger("prefix_cache.service")

WINDOW_S = 60
KEY_PREFIX = "prefix-cache:rate"
RETRY_REDIS_S = 5.0  # while Redis fails, how long requests count locally before it is tried again
Kind = Literal["requests", "tokens"]


class MinuteCounts(Protocol):
    """What a tenant spent in a minute window."""

    async def add(self, tenant: str, kind: Kind, window: int, amount: int) -> int:
        """Add ``amount``; the window's total after it."""
        ...

    async def get(self, tenant: str, kind: Kind, window: int) -> int: ...

    async def aclose(self) -> None: ...


class LocalCounts:
    """This worker's counts: the current window of each tenant and kind."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], tuple[int, int]] = {}

    async def add(self, tenant: str, kind: Kind, window: int, amount: int) -> int:
        return self.add_now(tenant, kind, window, amount)

    def add_now(self, tenant: str, kind: Kind, window: int, amount: int) -> int:
        held, used = self._counts.get((tenant, kind), (window, 0))
        used = (used if held == window else 0) + amount
        self._counts[(tenant, kind)] = (window, used)
        return used

    async def get(self, tenant: str, kind: Kind, window: int) -> int:
        held, used = self._counts.get((tenant, kind), (window, 0))
        return used if held == window else 0

    async def aclose(self) -> None:
        return None


class RedisCounts:
    """Counts shared through Redis; this worker's own counts while Redis fails."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._client: Any = None     # made on first use, on the serving event loop
        self._local = LocalCounts()
        self._failing = False
        self._retry_at = 0.0  # while failing: no Redis call (and no timeout's wait) before this

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(
                self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s)
        return self._client

    @staticmethod
    def key(tenant: str, kind: Kind, window: int) -> str:
        return f"{KEY_PREFIX}:{tenant}:{kind}:{window}"

    async def add(self, tenant: str, kind: Kind, window: int, amount: int) -> int:
        local = self._local.add_now(tenant, kind, window, amount)
        if self._failing and time.monotonic() < self._retry_at:
            return local
        try:
            async with self._redis().pipeline(transaction=True) as pipe:
                pipe.incrby(self.key(tenant, kind, window), amount)
                pipe.expire(self.key(tenant, kind, window), 2 * WINDOW_S)
                total, _ = await pipe.execute()
        except Exception as exc:  # redis' errors, timeouts, OSError: count here instead
            return self._fell_back(exc, local)
        self._recovered()
        return int(total)

    async def get(self, tenant: str, kind: Kind, window: int) -> int:
        if self._failing and time.monotonic() < self._retry_at:
            return await self._local.get(tenant, kind, window)
        try:
            value = await self._redis().get(self.key(tenant, kind, window))
        except Exception as exc:
            return self._fell_back(exc, await self._local.get(tenant, kind, window))
        self._recovered()
        return int(value or 0)

    def _fell_back(self, exc: Exception, local: int) -> int:
        self._retry_at = time.monotonic() + RETRY_REDIS_S
        if not self._failing:
            log.warning("rate limits: Redis failed (%r); counting in this worker until it "
                        "answers again", exc)
            self._failing = True
        return local

    def _recovered(self) -> None:
        if self._failing:
            log.info("rate limits: Redis answers again; counts are shared again")
            self._failing = False

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class RateLimits:
    """Checks and counts each tenant's minute (see the module docstring)."""

    def __init__(self, counts: MinuteCounts, clock: Callable[[], float] = time.time) -> None:
        self.counts = counts
        self.clock = clock

    def _window(self) -> tuple[int, int]:
        """The current window and the whole seconds until the next one (at least 1)."""
        now = self.clock()
        window = int(now // WINDOW_S)
        return window, max(1, math.ceil((window + 1) * WINDOW_S - now))

    async def admit(self, tenant: str, requests_per_minute: int | None,
                    tokens_per_minute: int | None) -> None:
        """Count a request; TooManyRequests when the tenant's minute is spent."""
        window, retry = self._window()
        if tokens_per_minute is not None:
            used = await self.counts.get(tenant, "tokens", window)
            if used >= tokens_per_minute:
                raise _spent(tenant, f"{used} prompt tokens of {tokens_per_minute} per minute",
                             retry, "tenant_tokens_per_minute")
        if requests_per_minute is not None:
            used = await self.counts.add(tenant, "requests", window, 1)
            if used > requests_per_minute:
                raise _spent(tenant, f"{requests_per_minute} requests per minute", retry,
                             "tenant_requests_per_minute")

    async def spend_tokens(self, tenant: str, tokens_per_minute: int | None, tokens: int) -> None:
        """Count a prepared request's prompt tokens (only where a limit needs them)."""
        if tokens_per_minute is not None and tokens > 0:
            await self.counts.add(tenant, "tokens", self._window()[0], tokens)

    async def aclose(self) -> None:
        await self.counts.aclose()


def _spent(tenant: str, what: str, retry_s: int, code: str) -> TooManyRequests:
    return TooManyRequests(f"tenant {tenant!r} has spent its {what}; retry after {retry_s} s",
                           retry_after_s=retry_s, code=code)

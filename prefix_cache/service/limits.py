"""Per-tenant limits, so one tenant cannot slow the others down.

What a request costs the sidecar itself -- reading its body, checking it, rendering its prompt
and probes -- runs on one event loop and one render pool per worker. Without a bound, a tenant
sending many large prompts at once fills the pool and every other tenant's hits wait behind
them. So, per tenant and per worker:

- ``max_concurrency`` of its requests are prepared at once (body read through boundary
  resolved; the upstream's generation afterwards is not counted: the upstream has its own
  queue). Reading the body inside the slot also bounds the memory one tenant's bodies take.
- ``max_queue`` more wait in line, each at most ``queue_timeout_s``; past either, a 429 with
  ``Retry-After``.
- ``max_prompt_bytes`` bounds the text one request gives the template (its messages without
  image or audio data, its tools and template kwargs, as JSON): larger is a 413 before any
  render.
- ``requests_per_minute`` and ``tokens_per_minute`` (prompt tokens), none by default: shared
  through Redis with ``--redis``, else per worker (``rate_limits.py``).

Defaults come from the settings; the keys file may override them per tenant
(``tenant_limits: {acme: {max_concurrency: 8}}``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..http.errors import PayloadTooLarge, TooManyRequests
from ..util import json_io
from .rate_limits import LocalCounts, RateLimits, RedisCounts
from .settings import ServiceSettings

RATE_TIMEOUT_S = 0.25  # a rate count waits longer than a lookup: a count cannot be computed
RETRY_AFTER_S = 1  # slots free up in milliseconds to seconds: a second is a fair first retry
# Content parts whose data a template never renders as text (it renders a placeholder).
MEDIA_PARTS = frozenset(("image_url", "image", "input_image", "input_audio", "audio", "file",
                         "input_file", "video", "video_url"))


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's limits."""

    max_concurrency: int
    max_queue: int
    max_prompt_bytes: int
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


class TenantLimitOverride(BaseModel):
    """A tenant's entry under ``tenant_limits`` in the keys file: what it changes."""

    model_config = ConfigDict(extra="forbid")

    max_concurrency: int | None = Field(default=None, gt=0)
    max_queue: int | None = Field(default=None, ge=0)
    max_prompt_bytes: int | None = Field(default=None, gt=0)
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)

    def applied_to(self, base: TenantLimit) -> TenantLimit:
        return replace(base, **self.model_dump(exclude_none=True))


class _Gate:
    """One tenant's slots and its line of waiters (first come, first served)."""

    def __init__(self) -> None:
        self.active = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self, limit: TenantLimit, timeout_s: float, tenant: str) -> None:
        if self.active < limit.max_concurrency and not self.waiters:
            self.active += 1
            return
        if len(self.waiters) >= limit.max_queue:
            raise _busy(tenant, f"{limit.max_concurrency} requests are being prepared and "
                                f"{len(self.waiters)} are waiting")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just as the wait ended: pass it on
            else:
                self.waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise _busy(tenant, f"no slot freed within {timeout_s:g} s") from None
            raise

    def release(self) -> None:
        """Hand the slot to the first waiter still waiting, or free it."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: ``active`` stays the same
                return
        self.active -= 1


def _busy(tenant: str, why: str) -> TooManyRequests:
    return TooManyRequests(f"too many concurrent requests for tenant {tenant!r}: {why}; retry "
                           f"after {RETRY_AFTER_S} s", retry_after_s=RETRY_AFTER_S,
                           code="tenant_concurrency_limit")


class TenantLimits:
    """Every tenant's limits and slots in one worker."""

    def __init__(self, default: TenantLimit, overrides: Mapping[str, TenantLimitOverride]
                 | None = None, *, queue_timeout_s: float,
                 rates: RateLimits | None = None) -> None:
        self.default = default
        self.queue_timeout_s = queue_timeout_s
        self.rates = rates or RateLimits(LocalCounts())
        self._limits: dict[str, TenantLimit] = {}
        self.update(overrides or {})
        self._gates: dict[str, _Gate] = {}   # one per tenant: tenants are configured, bounded

    @classmethod
    def from_settings(cls, settings: ServiceSettings,
                      overrides: Mapping[str, TenantLimitOverride] | None = None) -> TenantLimits:
        default = TenantLimit(settings.tenant_max_concurrency, settings.tenant_max_queue,
                              settings.max_prompt_bytes)
        counts = (LocalCounts() if settings.uses_memory_store or settings.redis_url is None
                  else RedisCounts(settings.redis_url, max(settings.redis_timeout_s,
                                                           RATE_TIMEOUT_S)))
        return cls(default, overrides, queue_timeout_s=settings.tenant_queue_timeout_s,
                   rates=RateLimits(counts))

    def update(self, overrides: Mapping[str, TenantLimitOverride]) -> None:
        """Every tenant's limits from ``overrides`` (a keys file re-read): requests already
        admitted keep their slots."""
        self._limits = {t: o.applied_to(self.default) for t, o in overrides.items()}

    def of(self, tenant: str) -> TenantLimit:
        return self._limits.get(tenant, self.default)

    def active(self, tenant: str) -> int:
        """How many of the tenant's slots are held now (read-only)."""
        gate = self._gates.get(tenant)
        return 0 if gate is None else gate.active

    def waiting(self, tenant: str) -> int:
        """How long the tenant's line for a slot is now (read-only; a full line refuses)."""
        gate = self._gates.get(tenant)
        return 0 if gate is None else len(gate.waiters)

    @asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of the tenant's slots; TooManyRequests when none frees up in time."""
        limit = self.of(tenant)
        if limit.requests_per_minute is not None or limit.tokens_per_minute is not None:
            await self.rates.admit(tenant, limit.requests_per_minute, limit.tokens_per_minute)
        gate = self._gates.setdefault(tenant, _Gate())
        await gate.acquire(limit, self.queue_timeout_s, tenant)
        try:
            yield
        finally:
            gate.release()

    async def spend_tokens(self, tenant: str, prompt_tokens: int) -> None:
        """A prepared request's prompt tokens, in its tenant's minute."""
        await self.rates.spend_tokens(tenant, self.of(tenant).tokens_per_minute, prompt_tokens)

    def check_prompt(self, tenant: str, body_size: int, messages: Sequence[Any],
                     tools: Any, kwargs: Any) -> None:
        """PayloadTooLarge if the text the template would get exceeds the tenant's limit
        (measured only when the whole body is larger than the limit)."""
        limit = self.of(tenant).max_prompt_bytes
        if body_size <= limit:
            return
        size = prompt_bytes(messages, tools, kwargs)
        if size > limit:
            raise PayloadTooLarge(
                f"the prompt gives the template {size} bytes of text (messages, tools and "
                f"chat_template_kwargs as JSON), over the limit of {limit} bytes "
                "(PREFIX_CACHE_MAX_PROMPT_BYTES)", code="prompt_too_large")


def prompt_bytes(messages: Sequence[Any], tools: Any, kwargs: Any) -> int:
    """The JSON size of what a template renders as text: every message field (content parts
    carrying media counted without their data), the tools, the kwargs."""
    size = len(json_io.dumps(tools)) + len(json_io.dumps(kwargs))
    for message in messages:
        if not isinstance(message, dict):
            continue
        for name, value in message.items():
            if name == "content" and isinstance(value, list):
                value = [part for part in value
                         if not (isinstance(part, dict) and part.get("type") in MEDIA_PARTS)]
            size += len(name) + len(json_io.dumps(value))
    return size

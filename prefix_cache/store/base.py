"""The store interface every backend implements, and the contract the cache relies on.

Four operations. Backends raise ``StoreUnavailableError`` and nothing else for any failure of
their own (down, slow, full), so the cache has one thing to catch and turn into a miss. The
calls made on the event loop (a request's lookup, an admin purge or delete, readiness) have
async forms; they default to the sync ones, which is right for a store that never blocks
(memory), and network stores override them, so no call on a loop ever blocks it. ``ping`` is
readiness: does the backend answer now, whatever a circuit breaker remembers. ``stats()`` is
one typed record for every backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """The in-process tier."""

    entries: int
    bytes: int
    max_bytes: int
    evictions: int
    expirations: int


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """The shared tier (Redis) and its circuit breaker."""

    url: str                # without its password
    breaker: str            # closed, open or half_open
    breaker_opened: int
    calls: int              # calls that reached the network
    errors: int
    skipped: int            # calls refused while the breaker was open
    busy: int = 0           # calls that waited for a connection in vain (not an outage)


@dataclass(frozen=True, slots=True)
class QuotaStats:
    """Per-tenant quotas in front of the store (what this process accounts to each tenant)."""

    max_entries: int
    max_bytes: int
    evictions: int
    tenants: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    pending_deletes: int = 0    # evicted entries whose delete the store has not confirmed yet


@dataclass(frozen=True, slots=True)
class StoreStats:
    """What a store reports, whatever its backend; the parts it does not have are None."""

    backend: str                        # memory, redis, redis-cluster or tiered
    memory: MemoryStats | None = None
    remote: RemoteStats | None = None
    quota: QuotaStats | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON of ``/admin/stats``."""
        out: dict[str, Any] = {"backend": self.backend}
        if self.memory is not None:
            out.update(asdict(self.memory))
        if self.remote is not None:
            out["remote"] = asdict(self.remote)
        if self.quota is not None:
            out.update(tenant_max_entries=self.quota.max_entries,
                       tenant_max_bytes=self.quota.max_bytes,
                       quota_evictions=self.quota.evictions,
                       quota_pending_deletes=self.quota.pending_deletes,
                       tenants=dict(self.quota.tenants))
        return out


class Store(ABC):
    """A bytes key-value store with optional per-entry TTL."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None if absent or expired."""

    @abstractmethod
    def put(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        """Store ``value``; ``ttl_seconds`` None means the store's default."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""

    @abstractmethod
    def purge(self, pattern: str) -> int:
        """Remove every key matching a glob ``pattern`` (``*`` and ``?``); the count removed."""

    async def aget(self, key: str) -> bytes | None:
        return self.get(key)

    async def adelete(self, key: str) -> bool:
        return self.delete(key)

    async def apurge(self, pattern: str) -> int:
        return self.purge(pattern)

    def ping(self) -> bool:
        """True if the backend answers now (an in-process store always does)."""
        return True

    async def aping(self) -> bool:
        return self.ping()

    async def awarm(self, connections: int) -> int:
        """Open up to ``connections`` connections to the backend ahead of the traffic (from the
        event loop that will use them); how many are open. Nothing to open in-process."""
        return 0

    def scan(self, pattern: str) -> Iterator[tuple[str, int]]:
        """(key, value bytes) for every key matching ``pattern``, for inventories; may be slow."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its keys")

    def stats(self) -> StoreStats:
        """The backend's figures, for metrics, the dashboard and readiness (a store of another
        kind reports just its name)."""
        return StoreStats(type(self).__name__)

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for stores without resources
        """Release connections; the store is not used afterwards."""

    async def aclose(self) -> None:
        """``close``, also closing connections that belong to the running event loop."""
        self.close()

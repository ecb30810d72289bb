"""Memory in front of Redis: write-through, and a Redis hit fills memory.

Coherence with purges done elsewhere (another replica's admin purge, a TTL in Redis) comes from a
short memory TTL (``local_ttl_seconds``, default 10 s), not from RESP3 client tracking. Tracking
in redis-py works only for the sync, non-cluster client with protocol 3, and this store uses the
asyncio client and Redis Cluster too; one mechanism that works for every client is simpler to
trust. A stale memory entry is never wrong (entries are immutable functions of their key and
verified on read); the TTL only bounds how long a purged entry can still be served locally.

Purges and deletes through this store go to Redis first and clear memory only once Redis has
answered: a purge refused by a Redis outage changes nothing (all or nothing from this process's
view), so an operator can retry it, and the memory tier never claims a purge Redis did not do.
Their async forms run on the event loop's Redis client, so a purge of any size never blocks it.
"""

from __future__ import annotations

from collections.abc import Iterator

from .base import Store, StoreStats
from .memory import MemoryStore
from .steps import Steps, twins

DEFAULT_LOCAL_TTL_SECONDS = 10.0


class TieredStore(Store):
    """``local`` (memory) over ``remote`` (Redis). Remote failures still raise, so they are counted,
    but a write that reached memory is served from memory meanwhile."""

    def __init__(self, local: MemoryStore, remote: Store,
                 local_ttl_seconds: float | None = DEFAULT_LOCAL_TTL_SECONDS) -> None:
        self.local = local
        self.remote = remote
        self.local_ttl_seconds = DEFAULT_LOCAL_TTL_SECONDS if local_ttl_seconds is None else local_ttl_seconds
        if self.local_ttl_seconds <= 0:
            raise ValueError(f"local_ttl_seconds must be positive, got {local_ttl_seconds}")

    def _local_ttl(self, ttl_seconds: float | None) -> float:
        return self.local_ttl_seconds if ttl_seconds is None else min(ttl_seconds, self.local_ttl_seconds)

    def put(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        self.local.put(key, value, self._local_ttl(ttl_seconds))
        self.remote.put(key, value, ttl_seconds)

    # get is every hit's call: written out twice, as steps cost a hit ~2x (a generator run).
    def get(self, key: str) -> bytes | None:
        value = self.local.get(key)
        return self._filled(key, self.remote.get(key)) if value is None else value

    async def aget(self, key: str) -> bytes | None:
        value = self.local.get(key)
        return self._filled(key, await self.remote.aget(key)) if value is None else value

    def _filled(self, key: str, value: bytes | None) -> bytes | None:
        """A remote hit fills memory."""
        if value is not None:
            self.local.put(key, value, self.local_ttl_seconds)
        return value

    # delete and purge: each written once as steps (steps.py), paired sync and async.
    def _delete(self, key: str) -> Steps[bool]:
        in_remote = yield "delete", (key,)   # Redis first: memory cleared once Redis answered
        return self.local.delete(key) or bool(in_remote)

    def _purge(self, pattern: str) -> Steps[int]:
        remote = yield "purge", (pattern,)
        return max(remote, self.local.purge(pattern))

    delete, adelete = twins(_delete, "remote")
    purge, apurge = twins(_purge, "remote")

    def ping(self) -> bool:
        return self.remote.ping()

    async def aping(self) -> bool:
        return await self.remote.aping()

    async def awarm(self, connections: int) -> int:
        return await self.remote.awarm(connections)

    def scan(self, pattern: str) -> Iterator[tuple[str, int]]:
        return self.remote.scan(pattern)  # the shared tier is the inventory

    def stats(self) -> StoreStats:
        return StoreStats("tiered", memory=self.local.stats().memory,
                          remote=self.remote.stats().remote)

    def close(self) -> None:
        self.local.close()
        self.remote.close()

    async def aclose(self) -> None:
        self.local.close()
        await self.remote.aclose()

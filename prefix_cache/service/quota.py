"""Per-tenant entry quotas: a tenant's entries can only ever evict that same tenant's entries.

``TenantQuotaStore`` wraps the backing store. Per namespace (the second field of every key,
``<prefix>:<namespace>:<model>:<hash>``) it keeps the keys this process stored, in LRU order,
with their sizes. A put that would take a tenant over its entry or byte quota first deletes
that tenant's least recently used entries, never another tenant's, and only then stores. The
service sizes the memory store to the sum of the quotas, with the memory store's own entry
size, so the store's global LRU never has to evict anything: a tenant flooding the cache
churns only its own entries.

With a shared store (Redis) each process accounts for what it wrote itself: the quota bounds
what each worker adds per tenant, and the store's own memory policy is the backstop.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from collections import OrderedDict
from typing import Any

from ..store.base import Store
from ..store.memory import ENTRY_OVERHEAD_BYTES


def namespace_of(key: str) -> str | None:
    """The namespace field of a cache key, or None for a key of another shape."""
    parts = key.split(":", 3)
    return parts[1] if len(parts) == 4 else None


def entry_size(key: str, value: bytes) -> int:
    """What an entry costs, counted exactly as MemoryStore counts it."""
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES


class TenantQuotaStore(Store):
    """A store bounded per tenant in entries and bytes, LRU within each tenant."""

    def __init__(self, inner: Store, *, max_entries: int, max_bytes: int) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries per tenant must be positive, got {max_entries}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes per tenant must be positive, got {max_bytes}")
        self.inner = inner
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._ledgers: dict[str, OrderedDict[str, int]] = {}
        self._bytes: dict[str, int] = {}
        self.quota_evictions = 0

    # -- accounting (under the lock, no I/O) ---------------------------------------------------

    def _admit(self, key: str, value: bytes) -> list[str] | None:
        """Account a put; the tenant's keys to delete first, or None if it cannot fit at all."""
        ns = namespace_of(key)
        if ns is None:
            return []
        size = entry_size(key, value)
        if size > self.max_bytes:
            return None  # larger than the whole quota: storing it would only empty the tenant
        with self._lock:
            ledger = self._ledgers.setdefault(ns, OrderedDict())
            self._bytes[ns] = self._bytes.get(ns, 0) - ledger.pop(key, 0) + size
            ledger[key] = size
            victims = []
            while len(ledger) > self.max_entries or self._bytes[ns] > self.max_bytes:
                oldest, oldest_size = ledger.popitem(last=False)
                self._bytes[ns] -= oldest_size
                victims.append(oldest)
            self.quota_evictions += len(victims)
            return victims

    def _forget(self, key: str) -> None:
        ns = namespace_of(key)
        if ns is None:
            return
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is not None and key in ledger:
                self._bytes[ns] -= ledger.pop(key)

    def _seen(self, key: str, value: bytes | None) -> None:
        """A read: refresh the key's place in its tenant's LRU, or forget a key that is gone."""
        if value is None:
            self._forget(key)
            return
        ns = namespace_of(key)
        if ns is None:
            return
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is not None and key in ledger:
                ledger.move_to_end(key)

    def _forget_matching(self, pattern: str) -> None:
        match = re.compile(fnmatch.translate(pattern)).match
        with self._lock:
            for ns, ledger in self._ledgers.items():
                for key in [k for k in ledger if match(k)]:
                    self._bytes[ns] -= ledger.pop(key)

    # -- the Store interface -------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        value = self.inner.get(key)
        self._seen(key, value)
        return value

    async def aget(self, key: str) -> bytes | None:
        value = await self.inner.aget(key)
        self._seen(key, value)
        return value

    def put(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        victims = self._admit(key, value)
        if victims is None:
            return
        for victim in victims:  # evict first, so the store never holds more than the quotas
            self.inner.delete(victim)
        try:
            self.inner.put(key, value, ttl_seconds)
        except BaseException:
            self._forget(key)
            raise

    async def aput(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        victims = self._admit(key, value)
        if victims is None:
            return
        for victim in victims:
            await self.inner.adelete(victim)
        try:
            await self.inner.aput(key, value, ttl_seconds)
        except BaseException:
            self._forget(key)
            raise

    def delete(self, key: str) -> bool:
        self._forget(key)
        return self.inner.delete(key)

    async def adelete(self, key: str) -> bool:
        self._forget(key)
        return await self.inner.adelete(key)

    def purge(self, pattern: str) -> int:
        self._forget_matching(pattern)
        return self.inner.purge(pattern)

    async def apurge(self, pattern: str) -> int:
        self._forget_matching(pattern)
        return await self.inner.apurge(pattern)

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        """Entries and bytes this process accounts to each tenant."""
        with self._lock:
            return {ns: {"entries": len(ledger), "bytes": self._bytes[ns]}
                    for ns, ledger in sorted(self._ledgers.items())}

    def stats(self) -> dict[str, Any]:
        return {
            **self.inner.stats(),
            "tenant_max_entries": self.max_entries,
            "tenant_max_bytes": self.max_bytes,
            "quota_evictions": self.quota_evictions,
            "tenants": self.tenant_usage(),
        }

    def close(self) -> None:
        self.inner.close()

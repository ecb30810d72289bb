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

The books never lose a stored key, outages included: a key leaves them only once the store has
confirmed it gone. An evicted entry whose delete fails stays on the tenant's pending list; the
tenant's next put retries those deletes first and stores nothing while any remains, so the
tenant never holds more than its quota. A put that fails keeps its key on the books (it may be
stored all the same: in the memory tier, or by Redis just before a timeout). Purges and deletes
forget keys only after the store did its part.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from dataclasses import replace

from ..cache.keys import parse_key
from ..util.lru import ByteLRU
from .base import QuotaStats, Store, StoreStats
from .memory import entry_size
from .steps import Steps, twins


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
        self._ledgers: dict[str, ByteLRU[str, None]] = {}
        self._pending: dict[str, set[str]] = {}  # per tenant: evicted, delete not yet confirmed
        self.quota_evictions = 0

    # -- accounting (under the lock, no I/O) ---------------------------------------------------

    def _ledger(self, key: str, create: bool = False) -> ByteLRU[str, None] | None:
        """The LRU of the key's tenant (made by a put); None for a key of another shape."""
        parts = parse_key(key)
        if parts is None:
            return None
        ledger = self._ledgers.get(parts.namespace)
        if ledger is None and create:
            ledger = self._ledgers[parts.namespace] = ByteLRU(self.max_bytes, self.max_entries)
        return ledger

    def _admit(self, key: str, value: bytes) -> list[str] | None:
        """Account a put; the tenant's keys to delete first (moved to its pending list), or None
        if it cannot fit at all (larger than the whole quota: storing it would only empty the
        tenant)."""
        with self._lock:
            ledger = self._ledger(key, create=True)
            if ledger is None:
                return []
            evicted = ledger.put(key, None, entry_size(key, value))
            if evicted is None:
                return None
            self.quota_evictions += len(evicted)
            victims = [victim for victim, _ in evicted]
            if victims:
                self._pending.setdefault(_tenant(key), set()).update(victims)
            return victims

    def _pending_of(self, key: str) -> list[str]:
        with self._lock:
            return sorted(self._pending.get(_tenant(key), ()))

    def _forget(self, key: str) -> None:
        """The store confirmed ``key`` gone (or never stored it)."""
        with self._lock:
            ledger = self._ledger(key)
            if ledger is not None:
                ledger.pop(key)
            self._pending.get(_tenant(key), set()).discard(key)

    def _delete_pending(self, keys: list[str]) -> None:
        """Delete evicted keys; each leaves the books once its delete succeeded. Raises
        ``StoreUnavailableError`` at the first failure (the rest stay pending)."""
        for victim in keys:
            self.inner.delete(victim)
            self._forget(victim)

    def _seen(self, key: str, value: bytes | None) -> bytes | None:
        """A read (its value, passed on): refresh the key's place in its tenant's LRU, or
        forget a key that is gone."""
        if value is None:
            self._forget(key)
            return None
        with self._lock:
            ledger = self._ledger(key)
            if ledger is not None:
                ledger.get(key)
        return value

    def _forget_matching(self, pattern: str) -> None:
        match = re.compile(fnmatch.translate(pattern)).match
        with self._lock:
            for ledger in self._ledgers.values():
                ledger.pop_where(lambda key, _: bool(match(key)))
            for pending in self._pending.values():
                pending.difference_update([key for key in pending if match(key)])

    # -- the Store interface -------------------------------------------------------------------

    def put(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        # Deletes an outage left undone come first: until they succeed the tenant's room is
        # still taken, so nothing new is stored.
        self._delete_pending(self._pending_of(key))
        victims = self._admit(key, value)
        if victims is None:
            return
        try:  # evict first, so the store never holds more than the quotas
            self._delete_pending(victims)
        except BaseException:
            self._forget(key)  # never sent
            raise
        self.inner.put(key, value, ttl_seconds)  # failed or not, the key stays on the books

    # get is every hit's call: written out twice, as steps cost a hit ~2x (a generator run).
    def get(self, key: str) -> bytes | None:
        return self._seen(key, self.inner.get(key))

    async def aget(self, key: str) -> bytes | None:
        return self._seen(key, await self.inner.aget(key))

    # delete and purge: each written once as steps (steps.py), paired sync and async.
    def _delete(self, key: str) -> Steps[bool]:
        removed = yield "delete", (key,)
        self._forget(key)  # only once the store did its part
        return bool(removed)

    def _purge(self, pattern: str) -> Steps[int]:
        removed = yield "purge", (pattern,)
        self._forget_matching(pattern)
        return int(removed)

    delete, adelete = twins(_delete, "inner")
    purge, apurge = twins(_purge, "inner")

    def ping(self) -> bool:
        return self.inner.ping()

    async def aping(self) -> bool:
        return await self.inner.aping()

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        """Entries and bytes this process accounts to each tenant."""
        with self._lock:
            return {ns: {"entries": len(ledger), "bytes": ledger.nbytes}
                    for ns, ledger in sorted(self._ledgers.items())}

    def pending_deletes(self) -> dict[str, list[str]]:
        """Per tenant, evicted keys whose delete the store has not confirmed yet."""
        with self._lock:
            return {ns: sorted(keys) for ns, keys in sorted(self._pending.items()) if keys}

    def stats(self) -> StoreStats:
        with self._lock:
            pending = sum(len(keys) for keys in self._pending.values())
        quota = QuotaStats(max_entries=self.max_entries, max_bytes=self.max_bytes,
                           evictions=self.quota_evictions, tenants=self.tenant_usage(),
                           pending_deletes=pending)
        return replace(self.inner.stats(), quota=quota)

    async def awarm(self, connections: int) -> int:
        return await self.inner.awarm(connections)

    def close(self) -> None:
        self.inner.close()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _tenant(key: str) -> str:
    """The namespace field of a key (keys of another shape are never on the books)."""
    parts = parse_key(key)
    return parts.namespace if parts is not None else ""

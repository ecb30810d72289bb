"""Stored OpenAI Responses, per tenant: what ``previous_response_id`` continues from and what
``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read.

A record is the response object as it was answered, the items of its whole conversation
(earlier turns, its input, its output: the next turn is that plus its own input) and where its
own input lies among them. Records are kept as JSON bytes: what is sized is what is held, and
no caller can change a stored response through what it was given.

An id is looked up in the caller's tenant alone, so no tenant can read, delete or learn of
another's.

A purge must stop what is in flight (issue 47): a response finishing after its tenant's purge
answered is not kept. The request takes a ``stamp`` of its namespace when it is admitted and
hands it to ``put``; a purge moves the namespace on, in the same step as (the memory store) or
before (Redis) it drops the records, and ``put`` keeps a record only while the stamp is still
current, checked in one step with the write. Two backends, one interface (``ResponseStore``):

- ``MemoryResponses``: a byte-bounded LRU per tenant in the process (one tenant's responses
  only ever evict that tenant's). Another worker, replica or a restart does not know the id.
- ``SharedResponses``: the sidecar's shared store (Redis), so every worker and replica finds
  every response; each record has a TTL, and one larger than a tenant's byte budget is not
  kept. The tenant's total is bounded by the TTL and Redis's own memory policy, not counted.
  The purge stamp is a counter in Redis per tenant (``prefix-cache-responses-purged:{<tenant>}``,
  the same hash slot as the tenant's records), so a purge through any replica fences a put on
  every other; ``put`` compares it and writes in one script.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..cache.keys import validate_label
from ..errors import StoreUnavailableError
from ..util import json_io
from ..util.lru import ByteLRU

if TYPE_CHECKING:
    from ..store.redis import RedisStore

log = logging.getLogger("prefix_cache.service")

DEFAULT_BYTES_PER_TENANT = 32 << 20
DEFAULT_TTL_SECONDS = 24 * 3600.0
ENTRY_OVERHEAD_BYTES = 128  # the id, the LRU's bookkeeping
SHARED_KEY_PREFIX = "prefix-cache-responses"
SHARED_PURGED_PREFIX = "prefix-cache-responses-purged"

PurgeStamp = str  # opaque: what ``stamp`` answered, for ``put``


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One response as kept: the object answered, its conversation, where its input is."""

    response: dict[str, Any]
    items: list[Any]            # earlier turns, this input, this output
    input_start: int
    input_end: int

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def input_items(self) -> list[Any]:
        return self.items[self.input_start:self.input_end]

    def to_bytes(self) -> bytes:
        return json_io.dumps({"response": self.response, "items": self.items,
                              "input": [self.input_start, self.input_end]})

    @classmethod
    def from_bytes(cls, value: bytes) -> StoredResponse:
        data = json_io.loads(value)
        start, end = data["input"]
        return cls(data["response"], data["items"], start, end)


class ResponseStore(Protocol):
    """Where a server keeps the responses it answered (see the module docstring)."""

    async def stamp(self, namespace: str) -> PurgeStamp:
        """Where ``namespace``'s purges stand now: taken when a request is admitted."""
        ...

    async def put(self, namespace: str, record: StoredResponse,
                  stamp: PurgeStamp | None = None) -> bool:
        """Keep a record unless the namespace was purged since ``stamp`` (None: unchecked);
        False when it was not kept (purged since, too large, the store failed)."""
        ...

    async def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        """This tenant's record of ``response_id``, or None."""
        ...

    async def delete(self, namespace: str, response_id: str) -> bool:
        """Forget this tenant's record; whether it was there."""
        ...

    async def purge(self, namespace: str | None) -> int:
        """Drop every record of a tenant (None: of every tenant); how many went."""
        ...

    async def aclose(self) -> None:
        """Release connections (on the loop that used them)."""
        ...


class MemoryResponses:
    """Records per tenant in this process, LRU within each tenant's byte budget."""

    def __init__(self, max_bytes_per_tenant: int = DEFAULT_BYTES_PER_TENANT) -> None:
        if max_bytes_per_tenant <= 0:
            raise ValueError(f"max_bytes_per_tenant must be positive, got {max_bytes_per_tenant}")
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self._lock = threading.Lock()
        self._tenants: dict[str, ByteLRU[str, bytes]] = {}
        self._purges: dict[str | None, int] = {}  # purges per namespace (None: of all)

    def _stamp(self, namespace: str) -> PurgeStamp:
        return f"{self._purges.get(namespace, 0)}:{self._purges.get(None, 0)}"

    async def stamp(self, namespace: str) -> PurgeStamp:
        with self._lock:
            return self._stamp(namespace)

    async def put(self, namespace: str, record: StoredResponse,
                  stamp: PurgeStamp | None = None) -> bool:
        value = record.to_bytes()
        with self._lock:  # the purge's lock: the stamp is checked and the record kept as one
            if stamp is not None and stamp != self._stamp(namespace):
                return False
            lru = self._tenants.get(namespace)
            if lru is None:
                lru = self._tenants[namespace] = ByteLRU(self.max_bytes_per_tenant)
            return lru.put(record.id, value, len(value) + len(record.id)
                           + ENTRY_OVERHEAD_BYTES) is not None

    async def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            lru = self._tenants.get(namespace)
            value = None if lru is None else lru.get(response_id)
        return None if value is None else StoredResponse.from_bytes(value)

    async def delete(self, namespace: str, response_id: str) -> bool:
        with self._lock:
            lru = self._tenants.get(namespace)
            return lru is not None and lru.pop(response_id) is not None

    async def purge(self, namespace: str | None) -> int:
        with self._lock:
            self._purges[namespace] = self._purges.get(namespace, 0) + 1
            names = list(self._tenants) if namespace is None else [namespace]
            return sum(len(self._tenants.pop(name, ())) for name in names)

    async def aclose(self) -> None:
        """Nothing to release."""

    def usage(self) -> dict[str, dict[str, int]]:
        """Responses and bytes kept per tenant."""
        with self._lock:
            return {ns: {"responses": len(lru), "bytes": lru.nbytes}
                    for ns, lru in sorted(self._tenants.items())}


class SharedResponses:
    """Records in Redis under ``prefix-cache-responses:{<tenant>}:<id>``,
    each with a TTL. A failing store keeps nothing on ``put`` (logged: the answer is already
    out) and raises ``StoreUnavailableError`` on reads (a 503: the client retries)."""

    def __init__(self, store: RedisStore, *, max_bytes: int = DEFAULT_BYTES_PER_TENANT,
                 ttl_seconds: float = DEFAULT_TTL_SECONDS) -> None:
        if max_bytes <= 0 or ttl_seconds <= 0:
            raise ValueError(f"max_bytes and ttl_seconds must be positive, got {max_bytes}, "
                             f"{ttl_seconds}")
        self.store, self.max_bytes, self.ttl_seconds = store, max_bytes, ttl_seconds

    @staticmethod
    def key(namespace: str, response_id: str) -> str | None:
        """The record's key; None for an id no server makes (``:``, glob characters ...)."""
        try:
            validate_label(response_id, "response id")
        except ValueError:
            return None
        # ``{tenant}``: a Redis Cluster hash tag, the records' slot is their purge marker's.
        return f"{SHARED_KEY_PREFIX}:{{{validate_label(namespace, 'namespace')}}}:{response_id}"

    @staticmethod
    def purged_key(namespace: str) -> str:
        """The counter of the tenant's purges, in its records' hash slot."""
        return f"{SHARED_PURGED_PREFIX}:{{{validate_label(namespace, 'namespace')}}}"

    async def stamp(self, namespace: str) -> PurgeStamp:
        """The tenant's purge counter now ("" before any purge); an unreachable store: ""
        too, and ``put`` then fails on the store as it would anyway."""
        try:
            value = await self.store.aget(self.purged_key(namespace))
        except StoreUnavailableError:
            return ""
        return "" if value is None else value.decode()

    async def put(self, namespace: str, record: StoredResponse,
                  stamp: PurgeStamp | None = None) -> bool:
        value, key = record.to_bytes(), self.key(namespace, record.id)
        if len(value) > self.max_bytes or key is None:
            return False
        try:  # the sync client: its bounded timeout, off the event loop
            if stamp is None:
                await asyncio.to_thread(self.store.put, key, value, self.ttl_seconds)
                return True
            kept = await asyncio.to_thread(self.store.put_if_equal, key, value, self.ttl_seconds,
                                           self.purged_key(namespace), stamp.encode())
        except StoreUnavailableError as exc:
            log.warning("a response could not be stored for previous_response_id: %s", exc)
            return False
        if not kept:
            log.info("a response finished after its tenant's purge was not stored")
        return kept

    async def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        key = self.key(namespace, response_id)
        value = None if key is None else await self.store.aget(key)
        return None if value is None else StoredResponse.from_bytes(value)

    async def delete(self, namespace: str, response_id: str) -> bool:
        key = self.key(namespace, response_id)
        return key is not None and await self.store.adelete(key)

    async def purge(self, namespace: str | None) -> int:
        """The tenant's counter moves first, then its records go: a put after the move is
        refused, one before it is found by the scan. ``None`` (every tenant) drops the records
        without fencing puts in flight (there is no marker every tenant's slot shares); the
        sidecar purges responses one tenant at a time."""
        if namespace is None:
            return await self.store.apurge(f"{SHARED_KEY_PREFIX}:*")
        await self.store.aincr(self.purged_key(namespace))
        tenant = validate_label(namespace, "namespace")
        return await self.store.apurge(f"{SHARED_KEY_PREFIX}:{{{tenant}}}:*")

    async def aclose(self) -> None:
        await self.store.aclose()

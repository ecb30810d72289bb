"""Stored OpenAI Responses, per tenant: what ``previous_response_id`` continues from and what
``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read.

A record is the response object as it was answered, the items of its whole conversation
(earlier turns, its input, its output: the next turn is that plus its own input) and where its
own input lies among them. Records are kept as JSON bytes: what is sized is what is held, and
no caller can change a stored response through what it was given.

An id is looked up in the caller's tenant alone, so no tenant can read, delete or learn of
another's. Two backends, one interface (``ResponseStore``):

- ``MemoryResponses``: a byte-bounded LRU per tenant in the process (one tenant's responses
  only ever evict that tenant's). Another worker, replica or a restart does not know the id.
- ``SharedResponses``: the sidecar's shared store (Redis), so every worker and replica finds
  every response; each record has a TTL, and one larger than a tenant's byte budget is not
  kept. The tenant's total is bounded by the TTL and Redis's own memory policy, not counted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from ..cache.keys import validate_label
from ..errors import StoreUnavailableError
from ..store.base import Store
from ..util import json_io
from ..util.lru import ByteLRU

log = logging.getLogger("prefix_cache.service")

DEFAULT_BYTES_PER_TENANT = 32 << 20
DEFAULT_TTL_SECONDS = 24 * 3600.0
ENTRY_OVERHEAD_BYTES = 128  # the id, the LRU's bookkeeping
SHARED_KEY_PREFIX = "prefix-cache-responses"


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

    async def put(self, namespace: str, record: StoredResponse) -> bool:
        """Keep a record; False when it was not kept (too large, the store failed)."""
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

    async def put(self, namespace: str, record: StoredResponse) -> bool:
        value = record.to_bytes()
        with self._lock:
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
    """Records in a shared ``Store`` (Redis) under ``prefix-cache-responses:<tenant>:<id>``,
    each with a TTL. A failing store keeps nothing on ``put`` (logged: the answer is already
    out) and raises ``StoreUnavailableError`` on reads (a 503: the client retries)."""

    def __init__(self, store: Store, *, max_bytes: int = DEFAULT_BYTES_PER_TENANT,
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
        return f"{SHARED_KEY_PREFIX}:{validate_label(namespace, 'namespace')}:{response_id}"

    async def put(self, namespace: str, record: StoredResponse) -> bool:
        value, key = record.to_bytes(), self.key(namespace, record.id)
        if len(value) > self.max_bytes or key is None:
            return False
        try:  # the sync client: its bounded timeout, off the event loop
            await asyncio.to_thread(self.store.put, key, value, self.ttl_seconds)
        except StoreUnavailableError as exc:
            log.warning("a response could not be stored for previous_response_id: %s", exc)
            return False
        return True

    async def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        key = self.key(namespace, response_id)
        value = None if key is None else await self.store.aget(key)
        return None if value is None else StoredResponse.from_bytes(value)

    async def delete(self, namespace: str, response_id: str) -> bool:
        key = self.key(namespace, response_id)
        return key is not None and await self.store.adelete(key)

    async def purge(self, namespace: str | None) -> int:
        tenant = "*" if namespace is None else validate_label(namespace, "namespace")
        return await self.store.apurge(f"{SHARED_KEY_PREFIX}:{tenant}:*")

    async def aclose(self) -> None:
        await self.store.aclose()

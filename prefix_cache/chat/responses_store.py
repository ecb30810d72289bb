"""Recent OpenAI Responses, per tenant, for ``previous_response_id``: each one as the items of
its whole conversation (earlier turns, its input, its output), so the next turn is that plus
its own input.

Each tenant has its own byte-bounded LRU (``prefix_cache.lru``): one tenant's responses only
ever evict that tenant's, and an id is looked up in the caller's tenant alone, so no tenant can
read, or learn of, another's. Items are kept as JSON bytes: what is sized is what is held, and
no caller can change a stored response through the list it was given. In-process only: another
worker, replica or a restart does not know the id (the client gets a clear 400 and resends).
"""

from __future__ import annotations

import threading
from typing import Any

from .. import json_io
from ..lru import ByteLRU

DEFAULT_BYTES_PER_TENANT = 32 << 20
ENTRY_OVERHEAD_BYTES = 128  # the id, the LRU's bookkeeping


class ResponseStore:
    """Response id -> conversation items, per tenant, LRU within each tenant's byte budget."""

    def __init__(self, max_bytes_per_tenant: int = DEFAULT_BYTES_PER_TENANT) -> None:
        if max_bytes_per_tenant <= 0:
            raise ValueError(f"max_bytes_per_tenant must be positive, got {max_bytes_per_tenant}")
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self._lock = threading.Lock()
        self._tenants: dict[str, ByteLRU[str, bytes]] = {}

    def put(self, namespace: str, response_id: str, items: list[Any]) -> bool:
        """Keep a response's conversation; False when it alone is larger than the budget."""
        value = json_io.dumps(items)
        with self._lock:
            lru = self._tenants.get(namespace)
            if lru is None:
                lru = self._tenants[namespace] = ByteLRU(self.max_bytes_per_tenant)
            return lru.put(response_id, value, len(value) + len(response_id)
                           + ENTRY_OVERHEAD_BYTES) is not None

    def get(self, namespace: str, response_id: str) -> list[Any] | None:
        """The conversation items of a response of this tenant, or None."""
        with self._lock:
            lru = self._tenants.get(namespace)
            value = None if lru is None else lru.get(response_id)
        return None if value is None else json_io.loads(value)

    def usage(self) -> dict[str, dict[str, int]]:
        """Responses and bytes kept per tenant."""
        with self._lock:
            return {ns: {"responses": len(lru), "bytes": lru.nbytes}
                    for ns, lru in sorted(self._tenants.items())}

"""Opening a store from a URL: the one place that maps configuration to a backend."""

from __future__ import annotations

from typing import Any

from .base import Store
from .memory import MemoryStore

MEMORY_SCHEMES = ("memory",)


def open_store(url: str | None = None, **options: Any) -> Store:
    """``None`` or ``memory://``: a MemoryStore; ``redis://``, ``rediss://``, ``unix://``: Redis
    (``redis+cluster://`` or ``?cluster=1`` for Redis Cluster), with memory in front (tiered)."""
    if not url or url.split(":", 1)[0] in MEMORY_SCHEMES:
        return MemoryStore(**{k: v for k, v in options.items() if k in _MEMORY_OPTIONS})
    from .redis import open_redis_store

    return open_redis_store(url, **options)


_MEMORY_OPTIONS = ("max_bytes", "max_entries", "ttl_seconds")

"""Stores for static-prefix entries: one interface, several backends.

``base.py`` (the interface and the contract the cache relies on), ``memory.py``, ``redis.py``
(with ``breaker.py``, a circuit breaker, and ``gate.py``, a bounded wait for a connection),
``tiered.py`` (memory in front of Redis), ``factory.py`` (a store from a URL), ``quota.py``
(per-tenant entry quotas), ``inventory.py`` (what a store holds, by tenant and model), ``steps.py`` (an operation
written once as steps, run by a sync and an async driver).
"""

from .base import Store
from .memory import MemoryStore

__all__ = ["MemoryStore", "Store"]

"""Stores for static-prefix entries: one interface, several backends."""

from .base import Store
from .memory import MemoryStore

__all__ = ["MemoryStore", "Store"]

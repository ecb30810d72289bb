"""Single-flight: one computation per key at a time, shared by threads and asyncio tasks.

Each in-flight key holds a ``concurrent.futures.Future``. A thread waits on it with ``result()``;
a task awaits it through ``asyncio.wrap_future`` (shielded, so one cancelled waiter does not
cancel the flight for the others). The leader releases the key only after storing the result,
so a request arriving in between finds it in the store instead of starting a second flight.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any


class SingleFlight:
    """Registry of in-flight computations by key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, Future[Any]] = {}

    def claim(self, key: str) -> tuple[Future[Any], bool]:
        """The flight for ``key`` and whether the caller leads it (must compute and release)."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                return flight, False
            flight = self._flights[key] = Future()
            return flight, True

    def release(self, key: str, flight: Future[Any]) -> None:
        """End the flight; later callers start afresh (and normally hit the store)."""
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]

    def __len__(self) -> int:
        return len(self._flights)

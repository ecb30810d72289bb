"""A bounded wait for one of a client's connections: a full pool means a busy server, not a dead one.

redis-py refuses a call the moment its pool is exhausted (``MaxConnectionsError``, a
``ConnectionError``, so it reads like an outage), and its blocking pool reports a wait that ran
out as a plain ``ConnectionError`` too. The gate sits in front of the pool instead: at most
``slots`` calls hold a connection at once, the rest wait up to ``wait_seconds`` for one, and a
call that still finds none gets ``StoreBusyError``, which the store keeps away from its circuit
breaker. The pool itself is never asked for more connections than it has.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from ..errors import StoreBusyError


class ConnectionGate:
    """``slots`` concurrent holders, a wait of at most ``wait_seconds`` for the others.

    ``hold`` serves threads; ``ahold`` serves the tasks of one event loop (its semaphore binds
    to that loop, as the asyncio client's connections do: one gate per client).
    """

    def __init__(self, slots: int, wait_seconds: float) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if wait_seconds <= 0:
            raise ValueError(f"wait_seconds must be positive, got {wait_seconds}")
        self.slots = slots
        self.wait_seconds = wait_seconds
        self._threads = threading.BoundedSemaphore(slots)
        self._tasks: asyncio.Semaphore | None = None
        self.busy = 0  # callers turned away after the whole wait
        self.holding = 0  # callers holding a slot now (read-only, for stats and tests)
        self._count = threading.Lock()  # threads move ``holding`` one at a time

    def _refuse(self) -> StoreBusyError:
        self.busy += 1
        return StoreBusyError(f"all {self.slots} store connections stayed busy for "
                              f"{self.wait_seconds * 1000:.0f} ms")

    @contextmanager
    def hold(self) -> Iterator[None]:
        if not self._threads.acquire(timeout=self.wait_seconds):
            raise self._refuse()
        try:
            with self._count:
                self.holding += 1
            yield
        finally:
            with self._count:
                self.holding -= 1
            self._threads.release()

    @asynccontextmanager
    async def ahold(self) -> AsyncIterator[None]:
        if self._tasks is None:
            self._tasks = asyncio.Semaphore(self.slots)
        try:
            async with asyncio.timeout(self.wait_seconds):
                await self._tasks.acquire()
        except TimeoutError:
            raise self._refuse() from None
        try:
            self.holding += 1
            yield
        finally:
            self.holding -= 1
            self._tasks.release()

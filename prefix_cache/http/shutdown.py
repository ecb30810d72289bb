"""Graceful shutdown: on SIGTERM, finish what is in flight, turn away what is new, then stop.

uvicorn alone, on SIGTERM, closes its listening socket at once (a request that reaches the
process in the meantime is refused or hangs in the backlog another worker shares) and then
waits for open connections. Here a SIGTERM first starts a drain:

1. every new request gets a 503 (``Retry-After``, ``Connection: close``), ``/readyz`` included,
   so clients and load balancers move on at once;
2. requests in flight, streams included, run to their end for at most the grace period; what
   still runs then is cancelled;
3. then uvicorn's own shutdown runs, with nothing left to wait for.

A second SIGTERM changes nothing (systemd signals every process of a unit, and uvicorn's
supervisor forwards one more to each worker); SIGINT (Ctrl-C) goes straight to uvicorn as before.
The hook is installed by the app's lifespan, which runs inside uvicorn's signal capture, in the
main thread of a server process (one worker or each of several); elsewhere (a server in a test
thread) there is no signal to take over and ``Drain.start`` is called directly.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

log = logging.getLogger("prefix_cache.service")

RETRY_AFTER_S = 1


class Drain:
    """The in-flight requests of one server, and whether it is draining."""

    def __init__(self, grace_s: float) -> None:
        if grace_s <= 0:
            raise ValueError(f"the shutdown grace period must be positive, got {grace_s}")
        self.grace_s = grace_s
        self.draining = False
        self.in_flight: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        """From now on new requests get 503."""
        if not self.draining:
            self.draining = True
            log.info("draining: %d request(s) in flight, new ones get 503", len(self.in_flight))

    def enter(self, task: asyncio.Task[Any]) -> None:
        self.in_flight.add(task)
        self._idle.clear()

    def leave(self, task: asyncio.Task[Any]) -> None:
        self.in_flight.discard(task)
        if not self.in_flight:
            self._idle.set()

    async def wait(self) -> bool:
        """Until nothing is in flight, or the grace period ends and what is left is cancelled;
        True if everything finished on its own."""
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._idle.wait(), self.grace_s)
            return True
        except TimeoutError:
            left = list(self.in_flight)
            log.warning("grace period of %.1f s over: cancelling %d request(s)", self.grace_s,
                        len(left))
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
            return False
        finally:
            log.info("drained in %.2f s", time.monotonic() - started)


class DrainMiddleware:
    """Counts HTTP requests in flight; while draining answers new ones 503."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:  # in the error shape of the API asked for
            refusal = error_response(503, "the server is shutting down; retry the request",
                                     "server_error", "shutting_down",
                                     {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
                                     path=scope.get("path", ""))
            await refusal(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None  # an ASGI app always runs in a task
        self.drain.enter(task)
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave(task)


def drain_on_sigterm(drain: Drain) -> Callable[[], None]:
    """Make SIGTERM drain first, then hand over to the handler installed before (uvicorn's);
    the function that undoes it. A no-op outside the main thread or without a handler to hand
    over to."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous):
        return lambda: None
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def finish() -> None:
        await drain.wait()
        previous(signal.SIGTERM, None)  # uvicorn: stop serving, then its own shutdown

    def spawn() -> None:
        task = loop.create_task(finish())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def on_sigterm(signum: int, frame: Any) -> None:
        if drain.draining:
            return
        drain.start()
        loop.call_soon_threadsafe(spawn)  # wakes the loop, wherever the signal found it

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)
    return restore

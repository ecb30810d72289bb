"""A server's connections: graceful shutdown, and idle or slow connections closed.

Graceful shutdown: on SIGTERM, finish what is in flight, turn away what is new, then stop.

uvicorn alone, on SIGTERM, closes its listening socket at once (a request that reaches the
process in the meantime is refused or hangs in the backlog another worker shares) and then
waits for open connections. Here a SIGTERM first starts a drain:

1. every new request gets a 503 (``Retry-After``, ``Connection: close``), ``/readyz`` included,
   so clients and load balancers move on at once;
2. requests in flight, streams included, run to their end for at most the grace period; what
   still runs then is cancelled;
3. then uvicorn's own shutdown runs, with nothing left to wait for.

SIGINT (Ctrl-C) does exactly the same. A second signal changes nothing (systemd signals every
process of a unit, uvicorn's supervisor forwards one more to each worker, a terminal's Ctrl-C
reaches every process of its group): the grace period bounds the wait. The hook is installed by the app's lifespan, which runs inside uvicorn's signal capture, in the
main thread of a server process (one worker or each of several); elsewhere (a server in a test
thread) there is no signal to take over and ``Drain.start`` is called directly.

Idle and slow connections: a deadline for a request's head, and a cap on open
connections that sheds idle ones first (nginx's ``client_header_timeout`` and
``worker_connections``, Envoy's ``request_headers_timeout`` and ``max_connections``).

uvicorn has an idle keep-alive timeout (``timeout_keep_alive``) but it is armed only after a
response, and any byte cancels it: a connection that never sends a byte, or sends its headers a
byte at a time, is kept for ever, and enough of them exhaust the open-file limit, so that
``accept`` fails and nobody is served. ``GuardedH11Protocol`` is uvicorn's h11 protocol with
(``connection_options`` gives uvicorn the class and the limits):

- **a head deadline**: from the connection's opening (and again from each response's end) the
  request line and headers must all be in within ``header_timeout_s``, or the connection is
  closed. Trickled bytes do not extend it.
- **a connection cap**: past ``max_connections`` open connections, a new one closes the one
  idle longest (waiting for a request head); when every connection is in a request, the new
  one is closed. Real clients send their head at once, so idle floods cannot lock them out.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_response

log = logging.getLogger("prefix_cache.service")

RETRY_AFTER_S = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Drain:
    """The in-flight requests of one server, and whether it is draining."""

    def __init__(self, grace_s: float) -> None:
        if grace_s <= 0:
            raise ValueError(f"the shutdown grace period must be positive, got {grace_s}")
        self.grace_s = grace_s
        self.draining = False
        self.in_flight: set[asyncio.Task[Any]] = set()
        self.cut: set[asyncio.Task[Any]] = set()   # cancelled at the end of the grace period
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self, reason: str = "") -> None:
        """From now on new requests get 503."""
        if not self.draining:
            self.draining = True
            log.info("%sdraining: %d request(s) in flight, new ones get 503 (grace %.0f s)",
                     f"{reason}: " if reason else "", len(self.in_flight), self.grace_s)

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
                self.cut.add(task)
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
            await self._refuse(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None  # an ASGI app always runs in a task
        self.drain.enter(task)
        started = False

        async def send_watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except asyncio.CancelledError:
            if task not in self.drain.cut:
                raise
            # Cut at the end of the grace period (the drain said so in one line): no traceback.
            # An answer not begun gets the 503; one begun ends unfinished (its connection
            # closed), so the client knows it is incomplete.
            task.uncancel()
            if not started:
                await self._refuse(scope, receive, send)
        finally:
            self.drain.cut.discard(task)
            self.drain.leave(task)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
        refusal = error_response(503, "the server is shutting down; retry the request",
                                 "server_error", "shutting_down",
                                 {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
                                 path=scope.get("path", ""))
        await refusal(scope, receive, send)


def drain_on_signals(drain: Drain) -> Callable[[], None]:
    """Make SIGTERM and SIGINT drain first, then hand over to the handler installed before
    (uvicorn's); the function that undoes it. A no-op outside the main thread or without a
    handler to hand over to."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    if not all(callable(handler) for handler in previous.values()):
        return lambda: None
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def finish(signum: int) -> None:
        await drain.wait()
        handler = previous[signum]
        assert callable(handler)
        handler(signum, None)  # uvicorn: stop serving, then its own shutdown

    def spawn(signum: int) -> None:
        task = loop.create_task(finish(signum))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def on_signal(signum: int, frame: Any) -> None:
        if drain.draining:
            return
        drain.start(signal.Signals(signum).name)
        loop.call_soon_threadsafe(spawn, signum)  # wakes the loop, wherever the signal found it

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)

    def restore() -> None:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is on_signal:
                signal.signal(signum, handler)
    return restore


@dataclass
class Stopped:
    """The stop signal that arrived, if one did."""

    signum: int | None = None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None


@contextmanager
def stop_signals_interrupt() -> Iterator[Stopped]:
    """Until a server takes the signals over: SIGTERM, like SIGINT, raises KeyboardInterrupt in
    the main thread (so ``finally`` blocks clean up what was half made), and the signal is
    recorded. Outside the main thread, nothing changes."""
    stopped = Stopped()
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return

    def interrupt(signum: int, frame: Any) -> None:
        if stopped.signum is None:
            stopped.signum = signum
        raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in STOP_SIGNALS}
    try:
        yield stopped
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# -- idle and slow connections ----------------------------------------------------------------


DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
# Open files kept for what each connection needs besides itself (an upstream connection, Redis,
# model and KV files): half of the limit goes to client connections.
FILES_PER_CONNECTION = 2
FILES_RESERVED = 128
MIN_CONNECTIONS = 32


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit (as nginx's
    ``worker_rlimit_nofile``); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(open_files: int) -> int:
    """Client connections that leave room for each one's upstream connection and the rest."""
    return max(MIN_CONNECTIONS, (open_files - FILES_RESERVED) // FILES_PER_CONNECTION)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head deadline (``header_timeout_s``) and the connection
    cap (uvicorn's ``limit_concurrency``, kept below it by shedding, so uvicorn's own 503
    for too many connections never comes). A module-level class, so worker processes find it
    by name; ``guarded_h11`` makes one with another deadline."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limit_concurrency
        if cap is not None and len(self.connections) >= cap and not self._shed():
            log.warning("connection limit (%d) reached with every connection in a request: "
                        "a new one is refused", cap)
            transport.close()
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in: a request runs
            self._head_received()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_head()  # the next request's head, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_received()
        super().connection_lost(exc)

    @property
    def _idle(self) -> OrderedDict[GuardedH11Protocol, None]:
        """This server's connections waiting for a request head, oldest first."""
        return _IDLE.setdefault(self.server_state, OrderedDict())

    def _await_head(self) -> None:
        self._head_received()
        self._idle[self] = None
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_too_late)

    def _head_received(self) -> None:
        self._idle.pop(self, None)
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_late(self) -> None:
        self._head_deadline = None
        self._idle.pop(self, None)
        log.info("a connection sent no complete request head within %.1f s: closed",
                 self.header_timeout_s)
        self.transport.close()

    def _shed(self) -> bool:
        """Close the connection idle longest to make room for this one; False if none is."""
        for victim in self._idle:
            if victim is not self:
                victim._head_received()
                victim.transport.close()
                log.info("connection limit reached: the connection idle longest was closed")
                return True
        return False


_IDLE: WeakKeyDictionary[Any, OrderedDict[GuardedH11Protocol, None]] = WeakKeyDictionary()


def guarded_h11(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> type[GuardedH11Protocol]:
    """The protocol class with this head deadline (``uvicorn.Config(http=...)``)."""
    if header_timeout_s <= 0:
        raise ValueError(f"header timeout must be > 0 s, got {header_timeout_s}")
    if header_timeout_s == GuardedH11Protocol.header_timeout_s:
        return GuardedH11Protocol
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s})


def connection_options(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                       keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                       max_connections: int | None = None) -> dict[str, Any]:
    """uvicorn's options for these limits (None connections: as many as the open-file limit,
    raised to its hard limit, leaves room for)."""
    if max_connections is None:
        max_connections = default_max_connections(raise_open_file_limit())
    if max_connections < 1:
        raise ValueError(f"max connections must be >= 1, got {max_connections}")
    return {"http": guarded_h11(header_timeout_s), "timeout_keep_alive": keep_alive_timeout_s,
            "limit_concurrency": max_connections + 1}  # the cap sheds before uvicorn's 503

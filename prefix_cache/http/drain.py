"""Graceful shutdown: on SIGTERM, finish what is in flight, turn away what is new, then stop.

uvicorn alone, on SIGTERM, closes its listening socket at once (a request that reaches the
process in the meantime is refused or hangs in the backlog another worker shares) and then
waits for open connections. Here a SIGTERM first starts a drain:

1. every new request gets a 503 (``Retry-After``, ``Connection: close``), ``/readyz`` included,
   so clients and load balancers move on at once;
2. requests in flight, streams included, run to their end for at most the grace period; what
   still runs then is cancelled: an answer not begun gets the 503, a stream begun ends with an
   error event in its API's shape (``errors.stream_error_event``), so the client reads why it
   is incomplete instead of a connection closed mid-stream;
3. then uvicorn's own shutdown runs, with nothing left to wait for.

SIGINT (Ctrl-C) does exactly the same. A second signal changes nothing (systemd signals every
process of a unit, uvicorn's supervisor forwards one more to each worker, a terminal's Ctrl-C
reaches every process of its group): the grace period bounds the wait. The hook is installed
by the app's lifespan, which runs inside uvicorn's signal capture, in the main thread of a
server process (one worker or each of several); elsewhere (a server in a test thread) there is
no signal to take over and ``Drain.start`` is called directly. (Idle and slow connections are
``connections.py``'s.)
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response, stream_error_event

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


CUT_MESSAGE = "the server is shutting down: the answer was cut at the end of its grace period"


class _ResponseSeen:
    """What a request has sent so far: begun, an event stream, ended."""

    def __init__(self) -> None:
        self.started = self.event_stream = self.ended = False
        self.between_events = True   # the body so far ends where an event may begin

    def see(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.event_stream = any(k.lower() == b"content-type"
                                    and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", ()))
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:  # a relayed chunk may end inside an event
                self.between_events = body.endswith((b"\n\n", b"\r\n\r\n"))
            self.ended = not message.get("more_body", False)


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
        response = _ResponseSeen()

        async def send_watched(message: Message) -> None:
            response.see(message)
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except asyncio.CancelledError:
            if task not in self.drain.cut:
                raise
            # Cut at the end of the grace period (the drain said so in one line): no traceback.
            task.uncancel()
            await self._end_cut(scope, receive, send, response)
        finally:
            self.drain.cut.discard(task)
            self.drain.leave(task)

    async def _end_cut(self, scope: Scope, receive: Receive, send: Send,
                       response: _ResponseSeen) -> None:
        """End a request cut at the grace's end: an answer not begun gets the 503; a stream
        begun ends with an error event in its API's shape, then a complete body, so the client
        reads why it is incomplete; any other answer begun ends unfinished (its connection
        closed), so the client knows it is incomplete."""
        if not response.started:
            await self._refuse(scope, receive, send)
        elif response.event_stream and not response.ended:
            event = stream_error_event(CUT_MESSAGE, "shutting_down", scope.get("path", ""))
            if not response.between_events:
                event = b"\n\n" + event  # ends the event cut in half, so this one is read
            try:
                await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client left meanwhile: nothing to tell it
                pass

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

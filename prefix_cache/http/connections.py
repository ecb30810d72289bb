"""Idle and slow connections: a deadline for a request's head, and a cap on open connections
that sheds idle ones first (nginx's ``client_header_timeout`` and ``worker_connections``,
Envoy's ``request_headers_timeout`` and ``max_connections``).

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

Which connections are idle is read from the server's own set of connections (uvicorn's
``server_state.connections``) when the cap is reached, so no table outlives a server.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("prefix_cache.service")

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
    _idle_since: float | None = None   # when it began waiting for a request head; None: in one

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

    def _await_head(self) -> None:
        self._head_received()
        self._idle_since = time.monotonic()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_too_late)

    def _head_received(self) -> None:
        self._idle_since = None
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_late(self) -> None:
        self._head_deadline = None
        self._idle_since = None
        log.info("a connection sent no complete request head within %.1f s: closed",
                 self.header_timeout_s)
        self.transport.close()

    def _shed(self) -> bool:
        """Close the connection idle longest to make room for this one; False if none is.
        (A scan of the server's connections: it runs only when the cap is reached.)"""
        idle = [c for c in self.connections if c is not self
                and getattr(c, "_idle_since", None) is not None]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c._idle_since)
        victim._head_received()
        victim.transport.close()
        log.info("connection limit reached: the connection idle longest was closed")
        return True


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

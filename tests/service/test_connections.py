"""Idle and slow connections on real sockets: a head deadline, an idle keep-alive timeout, a
connection cap that sheds idle connections first, and logs that a flood cannot swell. The
sidecar (with a recording upstream) on a real uvicorn with the options ``serve`` gives it."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from prefix_cache.http.logs import RateLimitFilter
from prefix_cache.http.connections import connection_options, default_max_connections
from prefix_cache.service.upstream import Upstream
from tests.support.clock import Clock
from tests.support.loopback import local_client
from tests.support.recording_upstream import Recorder
from tests.support.server_thread import ServerThread
from tests.support.sidecar import served, sidecar_app

HEAD_S, IDLE_S, CAP = 0.5, 0.5, 16
CLOSED_WITHIN_S = 10.0  # bounds the waits below; what is checked is that the server closes


@pytest.fixture(scope="module")
def base(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> Iterator[str]:
    app = sidecar_app(served("demo", demo_tokenizer, Upstream(recorder_server[1])))
    options = connection_options(HEAD_S, IDLE_S, CAP)
    with ServerThread(app, log_level="critical", **options) as url:
        yield url


@pytest.fixture(scope="module")
def capped(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> Iterator[str]:
    """The same with a long head deadline: only the cap's shedding frees connections."""
    app = sidecar_app(served("demo", demo_tokenizer, Upstream(recorder_server[1])))
    with ServerThread(app, log_level="critical", **connection_options(60.0, IDLE_S, CAP)) as url:
        yield url


def connect(base: str) -> socket.socket:
    parts = urlsplit(base)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=CLOSED_WITHIN_S)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes the connection (reads until EOF, bounded)."""
    try:
        while sock.recv(65536):
            pass
        return True
    except (TimeoutError, ConnectionResetError) as exc:
        return isinstance(exc, ConnectionResetError)


def healthz(base: str) -> int:
    with local_client(base_url=base, timeout=CLOSED_WITHIN_S) as http:
        return http.get("/healthz").status_code


def test_a_connection_that_sends_nothing_is_closed(base: str) -> None:
    with connect(base) as sock:
        assert closed_by_server(sock)


def test_a_head_trickled_a_byte_at_a_time_is_closed_at_the_deadline(base: str) -> None:
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with connect(base) as sock:
        started = time.monotonic()
        try:
            for byte in head:  # a byte every 50 ms: each would reset an idle timer
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert closed_by_server(sock)
    assert time.monotonic() - started < len(head) * 0.05  # closed before the head was done


def test_an_idle_kept_alive_connection_is_closed_after_its_answer(base: str) -> None:
    with connect(base) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in sock.recv(65536)
        assert closed_by_server(sock)


def test_idle_connections_past_the_cap_lock_no_one_out(capped: str) -> None:
    """Four times the cap of connections that never send a byte (their deadline far off):
    every real request is still answered (the idle ones are shed, oldest first), and the
    newest idle ones are still open."""
    idle = [connect(capped) for _ in range(4 * CAP)]
    try:
        for _ in range(5):
            assert healthz(capped) == 200
        assert all(closed_by_server(s) for s in idle[:CAP])  # the oldest went first
        idle[-1].settimeout(0.3)
        assert not closed_by_server(idle[-1])
    finally:
        for sock in idle:
            sock.close()
    assert healthz(capped) == 200


def test_a_request_in_progress_is_never_shed(capped: str) -> None:
    """Connections in a request are not idle: a flood of new ones closes idle ones only."""
    with connect(capped) as busy:
        busy.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)  # its head is in before the flood
        flood = [connect(capped) for _ in range(2 * CAP)]
        try:
            busy.settimeout(0.5)
            with pytest.raises(TimeoutError):
                busy.recv(1)  # still open, waiting for its body
        finally:
            for sock in flood:
                sock.close()


def test_the_default_cap_leaves_room_for_upstream_connections() -> None:
    assert default_max_connections(1024) == 448
    assert default_max_connections(100) == 32
    with pytest.raises(ValueError, match="max connections"):
        connection_options(max_connections=0)
    with pytest.raises(ValueError, match="header timeout"):
        connection_options(header_timeout_s=0)


def test_logs_of_one_kind_are_rate_limited() -> None:
    clock = Clock()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    handler.addFilter(RateLimitFilter(burst=20, window_s=10.0, clock=clock))
    logger = logging.getLogger("prefix_cache.test_connections")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for i in range(1000):
            logger.warning("a connection from %s was closed", i)
        logger.warning("another kind of line")
        assert len(records) == 21
        clock.now += 10.0
        logger.warning("a connection from %s was closed", "again")
        assert records[-1].getMessage() == "[980 similar lines suppressed] a connection " \
            "from again was closed"
    finally:
        logger.removeHandler(handler)

"""The sidecar's client to its upstreams (``prefix_cache/http/upstream_client.py``) in front
of a stdlib ``http.server`` upstream (the kind ``mlx_lm.server`` is: the head and the body
written apart, no TCP_NODELAY): answers whole over one kept-alive connection, every
connection TCP_NODELAY, and on Linux quick ACKs re-armed before every read -- what removes
the ~45 ms stall (measured side by side in ``bench/relay_stall.py``; never timed here)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from prefix_cache.http.upstream_client import QUICKACK, QuickAckStream, upstream_client

BODY = json.dumps({"messages": [{"role": "system", "content": "x" * 27_000}]}).encode()


class Echo(BaseHTTPRequestHandler):
    """Answers the length it read and the client port it saw, head and body written apart."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        n = len(self.rfile.read(int(self.headers["content-length"])))
        answer = json.dumps({"read": n, "port": self.client_address[1]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def stdlib_upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_answers_come_whole_over_one_kept_alive_connection(stdlib_upstream: str) -> None:
    async def run() -> tuple[list[dict[str, Any]], Any, int]:
        client = upstream_client(httpx.Timeout(10.0), httpx.Limits(max_connections=4))
        async with client:
            answers = []
            for _ in range(5):
                r = await client.post(stdlib_upstream + "/v1/chat/completions", content=BODY)
                answers.append(r.json())
            stream = r.extensions["network_stream"]
            sock = stream.get_extra_info("socket")
            return answers, stream, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)

    answers, stream, nodelay = asyncio.run(run())
    assert {a["read"] for a in answers} == {len(BODY)}
    assert len({a["port"] for a in answers}) == 1          # one connection, kept alive
    assert nodelay != 0
    assert isinstance(stream, QuickAckStream) == (QUICKACK is not None)


@pytest.mark.skipif(QUICKACK is None, reason="no TCP_QUICKACK on this platform")
def test_quick_acks_are_asked_for_before_every_read() -> None:
    """Beside the real connection above: a stream whose socket notes the options set, so the
    order (the option, then the read) is seen."""
    calls: list[str] = []

    class Sock:
        def setsockopt(self, level: int, option: int, value: int) -> None:
            calls.append(f"setsockopt {level} {option} {value}")

    class Inner:
        def get_extra_info(self, info: str) -> Any:
            return Sock() if info == "socket" else None

        async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            calls.append("read")
            return b"x"

    assert QUICKACK is not None
    stream = QuickAckStream(Inner(), QUICKACK)  # type: ignore[arg-type]
    asyncio.run(stream.read(10))
    asyncio.run(stream.read(10))
    armed = f"setsockopt {socket.IPPROTO_TCP} {QUICKACK} 1"
    assert calls == [armed, "read", armed, "read"]

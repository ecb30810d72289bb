"""HTTP at the byte level, for what well-behaved clients and servers never do: an upstream that
answers with any status line at all, and a client that never stops sending a body.

Every wait is bounded by a socket timeout or a deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

SOCKET_TIMEOUT_S = 10.0


@contextmanager
def raw_upstream(response: bytes) -> Iterator[str]:
    """A server on loopback that reads each request's head and answers ``response`` verbatim,
    then closes; its base URL."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(SOCKET_TIMEOUT_S)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:  # read the whole request before answering
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            conn.sendall(response)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True, name=f"raw-upstream-{port}")
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(timeout=SOCKET_TIMEOUT_S)
        server.close()


def endless_chunked_post(base_url: str, path: str, *, max_bytes: int,
                         max_seconds: float) -> tuple[bytes, int, bool]:
    """POST a chunked body that never ends, until the server closes the connection or
    ``max_bytes``/``max_seconds`` run out: (what the server answered, bytes sent, closed)."""
    parts = urlsplit(base_url)
    chunk = b"[" * 65536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent, answer = 0, b""
    with socket.create_connection((parts.hostname, parts.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     .encode())
        sock.setblocking(False)
        deadline = time.monotonic() + max_seconds
        pending = memoryview(frame)   # the rest of the frame being sent: frames stay whole
        while sent < max_bytes and time.monotonic() < deadline:
            try:
                got = sock.recv(65536)
                if got == b"":
                    return answer, sent, True   # the server closed its side
                answer += got
            except BlockingIOError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                return answer, sent, True
            try:
                n = sock.send(pending)
                sent += n
                pending = pending[n:] or memoryview(frame)
            except BlockingIOError:
                time.sleep(0.001)   # the server is not reading: wait for it to close or read
            except (ConnectionResetError, BrokenPipeError):
                return answer, sent, True
        return answer, sent, False

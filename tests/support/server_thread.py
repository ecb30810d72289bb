"""An ASGI app on a real uvicorn in a thread, on loopback."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

STARTUP_TIMEOUT_S = 15.0


class ServerThread:
    """An ASGI app served by a real uvicorn in a thread, on a socket bound before it starts."""

    def __init__(self, app: Any, log_level: str = "warning", **config: Any) -> None:
        self.app = app
        self.log_level = log_level
        self.config = config  # more of uvicorn.Config's options

    def __enter__(self) -> str:
        # IPPROTO_TCP, as uvicorn binds: asyncio sets TCP_NODELAY only on such sockets'
        # connections, and without it every answer to a kept-alive client waits ~40 ms
        # (uvicorn writes the head and the body apart: Nagle, then the client's delayed ACK).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=self.log_level, lifespan="on",
                                timeout_graceful_shutdown=2, **self.config)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True, name=f"uvicorn-{port}")
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:  # readiness poll, bounded
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn on port {port} did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=STARTUP_TIMEOUT_S)

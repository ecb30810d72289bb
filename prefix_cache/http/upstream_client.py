"""The sidecar's pooled HTTP client to its upstreams, without the stall of Nagle's algorithm
meeting delayed ACKs on a kept-alive connection.

An upstream that writes its answer in pieces without TCP_NODELAY -- Python's ``http.server``,
which ``mlx_lm.server`` is: the head, then the body -- sends its second piece only once the
first is ACKed, and Linux delays that ACK (~40 ms) on a connection it has seen as
interactive: every relayed answer waited ~45 ms. Rule, from our side of the connection:

- TCP_NODELAY on every connection, so our own request's head and body leave at once;
- where the platform has TCP_QUICKACK (Linux), set again before every read: the kernel leaves
  quick-ACK mode on its own, so setting it once at connect does not remove the stall
  (measured: ``bench/relay_stall.py``), while before each read it does. Elsewhere (macOS) only
  TCP_NODELAY: an upstream's own TCP_NODELAY is then the fix.

httpx takes socket options but no network backend, so the transport is httpx's own with its
connection pool made over a backend whose streams re-arm quick ACKs (``QuickAckBackend``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
# None where the platform has no such option (macOS, Windows).
QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


class QuickAckStream(httpcore.AsyncNetworkStream):
    """A TCP stream that asks for an immediate ACK of whatever the next read receives."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, option: int) -> None:
        self.inner, self.option = inner, option
        self.sock = inner.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self.sock is not None:
            try:
                self.sock.setsockopt(socket.IPPROTO_TCP, self.option, 1)
            except OSError:  # closed under us: the read reports it
                pass
        return await self.inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self.inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        return await self.inner.start_tls(ssl_context, server_hostname, timeout)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class QuickAckBackend(httpcore.AsyncNetworkBackend):
    """httpcore's own backend, its TCP streams wrapped in ``QuickAckStream``."""

    def __init__(self, option: int, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.option = option
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        stream = await self.inner.connect_tcp(host, port, timeout, local_address,
                                              socket_options)
        return QuickAckStream(stream, self.option)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        return await self.inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class UpstreamTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, its pool's connections TCP_NODELAY and, where the platform allows,
    quick-ACKed before every read."""

    def __init__(self, limits: httpx.Limits, quickack: bool = True) -> None:
        super().__init__(limits=limits, trust_env=False, socket_options=[NODELAY])
        if quickack and QUICKACK is not None:
            # The pool httpx made, made again over the quick-ACK backend (httpx takes no
            # network backend of its own); everything else as httpx configures it.
            self._pool = httpcore.AsyncConnectionPool(
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_keepalive_connections,
                keepalive_expiry=limits.keepalive_expiry,
                socket_options=[NODELAY], network_backend=QuickAckBackend(QUICKACK))


def upstream_client(timeout: httpx.Timeout, limits: httpx.Limits,
                    quickack: bool = True) -> httpx.AsyncClient:
    """The worker's client to its upstreams (``quickack=False``: TCP_NODELAY only, the
    benchmark's baseline)."""
    return httpx.AsyncClient(timeout=timeout, transport=UpstreamTransport(limits, quickack),
                             trust_env=False)  # upstreams are configured, never from proxies

"""Relaying an upstream response to the client as it arrives; a client that leaves cancels it;
which of the upstream's headers reach the client.

Nothing is buffered: each chunk the upstream sends (an SSE event, a piece of JSON) is passed on
as soon as it is read. Both the wait for the upstream's answer and the relay itself race the
client's ``http.disconnect``: when the client goes, the upstream request is cancelled and its
connection closed, so the engine stops generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, TypeVar

import httpx
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .errors import error_body
from .request_id import HEADER as REQUEST_ID_HEADER
from .request_id import current_request_id

log = logging.getLogger("prefix_cache.service")

T = TypeVar("T")

# Which of an upstream's response headers reach the client, on every answer relayed and every
# error passed on: what a client's backoff and support requests read -- when to retry
# (``retry-after-ms`` then ``retry-after``, and ``x-should-retry``: what the OpenAI and
# Anthropic SDKs read), the rate limits (``x-ratelimit-*``, Anthropic's
# ``anthropic-ratelimit-*``), the upstream's request id -- and what describes a body relayed
# byte for byte (so its length and encoding stay true). Hop-by-hop headers, cookies and the
# upstream's own server details stay behind.
BODY_HEADERS = ("content-type", "content-length", "content-encoding", "cache-control")
BACKOFF_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry", "request-id")
RATE_LIMIT_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")
# x-request-id is ours (the one in our logs, sent upstream too): an upstream that answers with
# another one has it passed on under this name. Anthropic's request-id passes as it is.
UPSTREAM_REQUEST_ID_HEADER = "x-upstream-request-id"
MAX_HEADER_VALUE_CHARS = 256   # what a backoff or an id needs; a longer value is not passed on


def client_headers(upstream: Mapping[str, str], *, with_body: bool = True) -> dict[str, str]:
    """The headers of an upstream response the client gets (lower-case names); ``with_body``
    False: for an error whose body is rewritten here, so none of the body's own headers."""
    out: dict[str, str] = {}
    for name, value in upstream.items():
        name = name.lower()
        if len(value) > MAX_HEADER_VALUE_CHARS:
            continue
        if (name in BACKOFF_HEADERS or name.startswith(RATE_LIMIT_PREFIXES)
                or (with_body and name in BODY_HEADERS)):
            out[name] = value
    theirs = upstream.get(REQUEST_ID_HEADER)
    if theirs and theirs != current_request_id.get() and len(theirs) <= MAX_HEADER_VALUE_CHARS:
        out[UPSTREAM_REQUEST_ID_HEADER] = theirs
    return out


def relays_status(status: int) -> bool:
    """Whether an upstream status is passed on: a 2xx answer (relayed as it arrives) or a
    4xx/5xx error (relayed with its status, in OpenAI's shape).

    Everything else is a 502 instead. A 3xx is not followed (that would send the body, and the
    sidecar's upstream key, wherever the upstream points) nor passed on (its Location names
    the upstream's side of the network); a 1xx is not a final answer; a status outside
    [100, 600) is not HTTP and cannot be written to the client at all.
    """
    return 200 <= status < 300 or 400 <= status < 600


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[T | None, bool]:
    """Run ``work`` until it ends or the client disconnects; ``(result, disconnected)``.

    On a disconnect ``work`` is cancelled and waited for, so it has closed what it opened.
    An exception of ``work`` propagates.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.wait((task, watch))
    if task.cancelled():
        return None, True
    return task.result(), False


class RelayTap(Protocol):
    """Sees what is relayed (to keep a record of it); it never changes a byte, and delays one
    only while it keeps the record that byte completes."""

    async def feed(self, chunk: bytes) -> None:
        """A chunk about to be relayed (awaited first: a record it completes is kept before
        the client sees it)."""
        ...

    async def end(self) -> None:
        """The whole body was relayed."""
        ...


class RelayResponse(Response):
    """An open upstream response, streamed to the client chunk by chunk, closed at the end."""

    def __init__(self, upstream: httpx.Response, headers: Mapping[str, str],
                 tap: RelayTap | None = None,
                 error_event: Callable[[str], bytes] | None = None) -> None:
        self.upstream = upstream
        self.tap = tap
        self.error_event = error_event or _openai_error_event  # in the API's shape
        self.status_code = upstream.status_code
        self.background = None
        merged = client_headers(upstream.headers)
        merged.update(headers)
        self.is_event_stream = merged.get("content-type", "").startswith("text/event-stream")
        if self.is_event_stream:
            merged["x-accel-buffering"] = "no"  # tell proxies in front of us not to buffer either
        self.init_headers(merged)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            _, disconnected = await until_disconnect(receive, self._relay(send))
        finally:
            await asyncio.shield(self.upstream.aclose())
        if disconnected:
            log.info("client disconnected mid-response; upstream request closed")

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.tap is not None:
                    await self.tap.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if self.tap is not None:
                await self.tap.end()
        except httpx.HTTPError as exc:
            # The status is long sent; what is left is to end the body so the client sees why.
            log.warning("upstream failed mid-response: %r", exc)
            if self.is_event_stream:
                message = f"the upstream failed mid-stream ({type(exc).__name__})"
                await send({"type": "http.response.body", "body": self.error_event(message),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _openai_error_event(message: str) -> bytes:
    event = error_body(message, "upstream_error", "upstream_interrupted")
    return b"data: " + orjson.dumps(event) + b"\n\n"

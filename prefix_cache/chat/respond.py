"""Answering with a turn: one JSON body, or an SSE stream, in whichever API's shape.

A client that goes away cancels the generation: Starlette cancels a streaming body,
``until_disconnect`` a whole one, and closing the events' iterator stops the engine (or closes
the upstream response). An engine that fails before the answer has started is a 500 in the
API's error shape (the one place errors become responses, ``prefix_cache.http.errors``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine.protocol import BackendError
from ..http.errors import ClientDisconnected, EngineFailed
from ..http.relay import until_disconnect
from ..util import json_io

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def stream_response(events: AsyncIterator[bytes],
                    headers: Mapping[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={**SSE_HEADERS, **(headers or {})})


async def json_response(http_request: Request, body: Awaitable[dict[str, Any]],
                        headers: Mapping[str, str] | None = None) -> Response:
    """The whole answer once ``body`` is done; cancelled if the client leaves first."""
    try:
        data, disconnected = await until_disconnect(http_request.receive, body)
    except BackendError as exc:
        raise EngineFailed(str(exc)) from exc
    if disconnected or data is None:
        raise ClientDisconnected("the client disconnected before the answer was done")
    return Response(json_io.dumps(data), media_type="application/json", headers=headers)

"""Reading a JSON request body under a size limit."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from starlette.requests import ClientDisconnect

from .. import json_io
from .errors import BadRequest, ClientDisconnected, PayloadTooLarge


async def read_json_object(request: Request, limit: int,
                           setting: str | None = None) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its parsed JSON object; 413 past ``limit`` bytes (``setting``: what
    raises the limit, named in the message), 400 if not an object.

    A declared Content-Length over the limit is refused before a byte is read; a body sent
    without one (chunked) is counted as it arrives, so it is never held beyond the limit.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("invalid Content-Length header", code="invalid_content_length")
        if int(declared) > limit:
            raise _too_large(limit, setting)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit, setting)
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise ClientDisconnected("the client disconnected while sending the body") from exc
    raw = b"".join(chunks)
    try:
        body = json_io.loads(raw)  # integers of any size stay exact
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object (an OpenAI chat body)",
                         code="invalid_json")
    return raw, body


def _too_large(limit: int, setting: str | None) -> PayloadTooLarge:
    where = f" ({setting})" if setting else ""
    return PayloadTooLarge(f"the request body is larger than the limit of {limit} bytes{where}")

"""Reading a JSON request body: its content type, its size, its nesting, and its hints (the
body parser is ``fastpath.parse_body``; ``PartMemo`` is what it remembers per worker)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..util import json_io
from ..fastpath import PartMemo, parse_body
from ..util.hints import Hints
from .errors import BadRequest, ClientDisconnected, PayloadTooLarge, UnsupportedMediaType

JSON_MEDIA_TYPE = "application/json"
# Answering before the whole body is read leaves the rest of it on the connection: closing it
# is the only way to stop a client that keeps sending (a chunked body has no end to wait for).
CLOSE = {"Connection": "close"}


def require_json(content_type: str | None) -> None:
    """415 unless the body is declared ``application/json``.

    A browser sends ``text/plain``, form and multipart bodies cross-origin without asking
    first (a CORS "simple request"); ``application/json`` needs a preflight, which this
    service never grants, so no web page can make a visitor's browser post to it.
    """
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        shown = repr(media_type) if media_type else "none"
        raise UnsupportedMediaType(f"the body must be sent as Content-Type: {JSON_MEDIA_TYPE} "
                                   f"(got {shown})")


@dataclass(frozen=True, slots=True)
class JSONBody:
    """A request's raw body, its JSON object, and its hints: what its parse already worked out
    of it (the key material of parts its tenant sent before), for the cache."""

    raw: bytes
    data: dict[str, Any]
    hints: Hints


async def read_json_object(request: Request, limit: int, setting: str | None = None,
                           memo: PartMemo | None = None, scope: str = "",
                           share: bool = False) -> JSONBody:
    """The raw body and its parsed JSON object (``memo``, ``scope``, ``share``: where the exact
    bytes of large parts are remembered, whose they are, and whether their values may be
    shared with other requests: ``fastpath.parse_body``).

    415 unless it is ``application/json``; 413 past ``limit`` bytes (``setting``: what raises
    the limit, named in the message), closing the connection; 400 if it is not a JSON object
    or nests deeper than ``json_io.MAX_DEPTH``. A declared Content-Length over the limit is
    refused before a byte is read; a body sent without one (chunked) is counted as it arrives,
    so it is never held beyond the limit.
    """
    require_json(request.headers.get("content-type"))
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
        body, hints = parse_body(raw, memo, scope, share)  # ints exact; nesting bounded
    except json_io.JSONInputError as exc:
        raise BadRequest(f"the body is {exc}", code=exc.code) from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object (an OpenAI chat body)",
                         code="invalid_json")
    return JSONBody(raw, body, hints)


def _too_large(limit: int, setting: str | None) -> PayloadTooLarge:
    where = f" ({setting})" if setting else ""
    return PayloadTooLarge(f"the request body is larger than the limit of {limit} bytes{where}",
                           headers=CLOSE)

"""Request ids: every request gets one, every log line and the upstream see it, the client gets
it back in ``x-request-id``.

An incoming ``x-request-id`` is kept when it looks like an id (what proxies and tracers send:
letters, digits and ``._:-``, at most 128 characters); anything else is replaced by a fresh one,
so a client cannot write arbitrary text into the logs. The id lives in a context variable for
the request's whole life, so log records made while serving it (uvicorn's access line included)
carry it without being handed it.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_HEADER_BYTES = HEADER.encode()
_VALID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

current_request_id: ContextVar[str | None] = ContextVar("prefix_cache_request_id", default=None)


def request_id_from(value: str | None) -> str:
    """The caller's id if it looks like one, else a new one."""
    if value is not None and _VALID.fullmatch(value):
        return value
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Picks the request's id, keeps it current while the app runs, and returns it as a header
    (replacing any the app or the upstream set)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v.decode("latin-1") for k, v in scope["headers"] if k == _HEADER_BYTES), None)
        rid = request_id_from(sent)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != _HEADER_BYTES]
                message = {**message, "headers": [*headers, (_HEADER_BYTES, rid.encode())]}
            await send(message)

        token = current_request_id.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)

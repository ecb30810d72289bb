"""What one API request cost, noted as it goes and handed to the metrics when it ends.

An ASGI middleware opens a ``RequestRecord`` for each ``POST`` of an API path (chat
completions, Messages, Responses) and puts it in a context variable; the layers that learn
something note it there: the pipeline the tenant, model and cache result, the targets the
first content and the token counts (the engine's events, or an upstream's usage as it is
relayed). The middleware itself sees the status, the first byte of a body that is not
streamed, and the end. Other paths pass through untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_PATHS = {"/v1/chat/completions": "chat", "/v1/messages": "messages",
             "/v1/responses": "responses"}


@dataclass
class RequestRecord:
    """One request's labels and costs; times are ``time.perf_counter()`` values."""

    api: str
    started: float
    tenant: str = ""             # "" until the caller's key is known
    model: str = ""              # a served model's name, never a client's free text
    cache: str = "none"          # hit | miss | none (none also: nothing was resolved)
    status: int = 0
    streamed: bool = False
    first_content: float | None = None
    ended: float | None = None
    prompt_tokens: int = 0       # the prompt ids the sidecar cut, until a usage says otherwise
    cached_tokens: int = 0
    generation_tokens: int = 0

    def content_started(self) -> None:
        """The first content of the answer is on its way to the client (TTFT)."""
        if self.first_content is None:
            self.first_content = time.perf_counter()

    def usage(self, prompt: int | None, cached: int | None, generated: int | None) -> None:
        """Token counts an engine or upstream reported (None: not reported)."""
        if prompt is not None:
            self.prompt_tokens = prompt
        if cached is not None:
            self.cached_tokens = cached
        if generated is not None:
            self.generation_tokens = generated

    @property
    def latency_s(self) -> float:
        return (self.ended or time.perf_counter()) - self.started

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_content is None else self.first_content - self.started


_current: ContextVar[RequestRecord | None] = ContextVar("prefix_cache_request", default=None)


def current_record() -> RequestRecord | None:
    """The record of the request being served (None outside an API request)."""
    return _current.get()


class RequestRecordMiddleware:
    """Opens a record for each API request and hands it to ``on_done`` when the answer ends
    (whatever the status; an exception below reads as a 500)."""

    def __init__(self, app: ASGIApp, on_done: Callable[[RequestRecord], None],
                 paths: Mapping[str, str] = API_PATHS) -> None:
        self.app = app
        self.on_done = on_done
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self.paths.get(scope["path"]) if scope["type"] == "http" else None
        if api is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(api, time.perf_counter())
        token = _current.set(record)

        async def noting(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                record.streamed = any(name == b"content-type" and b"event-stream" in value
                                      for name, value in message.get("headers", ()))
            elif message["type"] == "http.response.body" and message.get("body"):
                if not record.streamed:  # a whole answer: its first byte is its first content
                    record.content_started()
            await send(message)

        try:
            await self.app(scope, receive, noting)
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            _current.reset(token)
            record.ended = time.perf_counter()
            self.on_done(record)

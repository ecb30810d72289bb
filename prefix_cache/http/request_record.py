"""What one API request cost, noted as it goes and handed to the metrics when it ends.

An ASGI middleware opens a ``RequestRecord`` for each ``POST`` of an API path (chat
completions, Messages, Responses) and puts it in a context variable; the layers that learn
something note it there: the pipeline the tenant, model and cache result and when the request
was handed to its engine or upstream, the targets each piece of content, the prefill's end,
the finish reason and the token counts (the engine's events, or an upstream's answer as it is
relayed). The middleware itself sees the status, the first byte of a body that is not
streamed, and the end. Other paths pass through untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_GAPS = 100_000   # inter-token gaps kept per request (a bounded answer has fewer)
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
    dispatched: float | None = None   # handed to the engine or upstream: the queue's end
    prefilled: float | None = None    # the engine said its prompt is prefilled
    first_content: float | None = None
    last_content: float | None = None
    content_gaps: list[float] = field(default_factory=list)  # between pieces of content
    finish_reason: str | None = None  # stop | length | tool_calls, as the engine ended
    ended: float | None = None
    on_dispatch: Callable[[], None] | None = None   # the metrics' running gauge
    prompt_tokens: int = 0       # the prompt ids the sidecar cut, until a usage says otherwise
    cached_tokens: int = 0
    generation_tokens: int = 0

    def content_started(self) -> None:
        """The first content of the answer is on its way to the client (TTFT); a no-op after."""
        if self.first_content is None:
            self.first_content = self.last_content = time.perf_counter()

    def content(self) -> None:
        """A piece of content (a token or more) generated: the first is the TTFT, the time
        since the one before an inter-token latency."""
        now = time.perf_counter()
        if self.last_content is not None:
            if len(self.content_gaps) < MAX_GAPS:
                self.content_gaps.append(now - self.last_content)
        if self.first_content is None:
            self.first_content = now
        self.last_content = now

    def dispatch(self) -> None:
        """The request is handed to its engine or upstream (its queue time ends)."""
        if self.dispatched is None:
            self.dispatched = time.perf_counter()
            if self.on_dispatch is not None:
                self.on_dispatch()

    def prefill_done(self) -> None:
        if self.prefilled is None:
            self.prefilled = time.perf_counter()

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

    @property
    def queue_s(self) -> float | None:
        """Request in to handed to the engine or upstream (tenant queue, boundary)."""
        return None if self.dispatched is None else self.dispatched - self.started

    @property
    def prefill_s(self) -> float | None:
        """Handed to the engine to its prompt prefilled (its Prefilled event, else the first
        content)."""
        end = self.prefilled or self.first_content
        return None if self.dispatched is None or end is None else max(0.0, end - self.dispatched)

    @property
    def decode_s(self) -> float | None:
        """Prefill's end to the last content."""
        start = self.prefilled or self.first_content
        if start is None or self.last_content is None:
            return None
        return max(0.0, self.last_content - start)


_current: ContextVar[RequestRecord | None] = ContextVar("prefix_cache_request", default=None)


def current_record() -> RequestRecord | None:
    """The record of the request being served (None outside an API request)."""
    return _current.get()


class RequestRecordMiddleware:
    """Opens a record for each API request, shows it to ``on_start``, and hands it to
    ``on_done`` as the answer's last byte goes out, or when the app returns without one
    (whatever the status; an exception below reads as a 500)."""

    def __init__(self, app: ASGIApp, on_done: Callable[[RequestRecord], None],
                 paths: Mapping[str, str] = API_PATHS,
                 on_start: Callable[[RequestRecord], None] | None = None) -> None:
        self.app = app
        self.on_done = on_done
        self.on_start = on_start
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self.paths.get(scope["path"]) if scope["type"] == "http" else None
        if api is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(api, time.perf_counter())
        if self.on_start is not None:
            self.on_start(record)
        token = _current.set(record)

        def done() -> None:
            if record.ended is None:
                record.ended = time.perf_counter()
                self.on_done(record)

        async def noting(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                record.streamed = any(name == b"content-type" and b"event-stream" in value
                                      for name, value in message.get("headers", ()))
            elif message["type"] == "http.response.body":
                if message.get("body") and not record.streamed:
                    record.content_started()  # a whole answer: its first byte, unless known
                if not message.get("more_body", False):
                    # Counted before the answer's last byte leaves: a client that reads the
                    # metrics once it has its answer finds it there.
                    done()
            await send(message)

        try:
            await self.app(scope, receive, noting)
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            _current.reset(token)
            done()

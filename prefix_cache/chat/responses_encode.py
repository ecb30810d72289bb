"""A turn's events as an OpenAI Response: one ``response`` object, or the SSE events
``response.created``, ``response.in_progress``, per output item ``response.output_item.added``
... ``response.output_item.done`` (a message: ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``, ``response.content_part.done``;
a function call: ``response.function_call_arguments.delta`` ..., ``.done``; the model's reasoning,
a ``reasoning`` item first: ``response.reasoning_text.delta`` ..., ``.done``), then
``response.completed`` -- or ``response.incomplete`` when ``max_output_tokens`` ended the turn
(status "incomplete", ``incomplete_details.reason`` "max_output_tokens"), as OpenAI's API does.
An engine failure mid-stream ends it with ``response.failed``.

``done(response)`` is awaited with the final response object (completed or incomplete) before
its last event leaves, so a caller keeps it for ``previous_response_id`` before the client can
send the next turn.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..engine.protocol import BackendError, Usage
from ..http.sse import SSEDecoder, sse_event
from ..util import json_io
from .events import (
    Collected,
    Finish,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    TurnEnd,
    collect,
    new_call_id,
)

log = logging.getLogger("prefix_cache.service")

Done = Callable[[dict[str, Any]], Awaitable[None]]
MAX_RECORDED_BYTES = 16 << 20  # a relayed answer larger than this is relayed, not kept


class ResponseObject(BaseModel):
    """The ``response`` object a Responses request is answered with (the OpenAPI
    document's); it also repeats the request's fields (instructions, tools, ...)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    model: str
    output: list[dict[str, Any]]    # message and function_call items
    usage: dict[str, Any] | None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """A response's id, model and the request fields it echoes."""

    id: str
    model: str
    echo: dict[str, Any] = field(default_factory=dict)
    created_at: int = field(default_factory=lambda: int(time.time()))
    # A namespace's functions by their name in the prompt: a call goes back as it was sent,
    # with its ``name`` in the namespace and the ``namespace``.
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)


def responses_usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def response_object(meta: ResponseMeta, status: str, output: list[dict[str, Any]],
                    usage: Usage | None = None, error: dict[str, Any] | None = None,
                    ) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": meta.id, "object": "response", "created_at": meta.created_at,
            "status": status, "error": error, "incomplete_details": incomplete,
            "model": meta.model, **meta.echo, "output": output,
            "usage": None if usage is None else responses_usage(usage)}


def _status(finish: Finish) -> str:
    return "incomplete" if finish.reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The model's reasoning as it wrote it (``content``), as vLLM returns it; no summary."""
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str,
              namespaces: Mapping[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if namespaces and name in namespaces:
        item["namespace"], item["name"] = namespaces[name]
    return item


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_items(turn: Collected, namespaces: Mapping[str, tuple[str, str]] | None = None,
                 ) -> list[dict[str, Any]]:
    status = _status(turn.finish)
    items = [reasoning_item(new_id("rs"), turn.reasoning, status)] if turn.reasoning else []
    items += [message_item(new_id("msg"), turn.text, status)] if turn.text else []
    return items + [call_item(new_id("fc"), c.id, c.name, c.arguments, status, namespaces)
                    for c in turn.calls]


async def response_json(meta: ResponseMeta, events: AsyncGenerator[OutputEvent, None],
                        done: Done) -> dict[str, Any]:
    turn = await collect(events)
    response = response_object(meta, _status(turn.finish), output_items(turn, meta.namespaces),
                               turn.finish.usage)
    await done(response)
    return response


async def response_stream(meta: ResponseMeta, events: AsyncGenerator[OutputEvent, None],
                          done: Done) -> AsyncGenerator[bytes, None]:
    """The SSE events of a response."""
    out = _Items(meta.namespaces)
    yield out.event("response.created", response=response_object(meta, "in_progress", []))
    yield out.event("response.in_progress", response=response_object(meta, "in_progress", []))
    end = TurnEnd()
    try:
        async with aclosing(end.content(events)) as content:  # closed with this stream
            async for event in content:
                for chunk in out.add(event):
                    yield chunk
    except BackendError as exc:  # the status is long sent: end the stream with the reason
        error = {"code": "server_error", "message": str(exc)}
        yield out.event("response.failed", response=response_object(
            meta, "failed", out.items, error=error))
        return
    status = _status(end.finish)
    for chunk in out.close(status):
        yield chunk
    response = response_object(meta, status, out.items, end.finish.usage)
    await done(response)
    kind = "response.incomplete" if status == "incomplete" else "response.completed"
    yield out.event(kind, response=response)


class _Items:
    """Output items opened and closed as the kind of event changes; numbers the events."""

    def __init__(self, namespaces: Mapping[str, tuple[str, str]] | None = None) -> None:
        self.namespaces = namespaces
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the finished ones
        self.open: dict[str, Any] | None = None
        self.key: tuple[str, int] | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(data, kind)

    def add(self, event: TextDelta | ReasoningDelta | ToolCallDelta) -> list[bytes]:
        """The events of one delta; the open item's index is the count of finished ones."""
        out: list[bytes] = []
        if isinstance(event, ReasoningDelta):
            if self.key != ("reasoning", 0) or self.open is None:
                out += self.close("completed")
                self.key = ("reasoning", 0)
                self.open = reasoning_item(new_id("rs"), "", "in_progress")
                out.append(self.event("response.output_item.added", output_index=self.at,
                                      item={**self.open, "content": []}))
            self.open["content"][0]["text"] += event.text
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=self.at, content_index=0, delta=event.text))
            return out
        if isinstance(event, TextDelta):
            if self.key != ("text", 0) or self.open is None:
                out += self.close("completed")  # an item followed by another is complete
                self.key, self.open = ("text", 0), message_item(new_id("msg"), "", "in_progress")
                out.append(self.event("response.output_item.added", output_index=self.at,
                                      item={**self.open, "content": []}))
                out.append(self.event("response.content_part.added", item_id=self.open["id"],
                                      output_index=self.at, content_index=0,
                                      part=_text_part("")))
            self.open["content"][0]["text"] += event.text
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=self.at, content_index=0, delta=event.text,
                                  logprobs=[]))
            return out
        if self.key != ("tool", event.index) or self.open is None:
            out += self.close("completed")
            self.key = ("tool", event.index)
            self.open = call_item(new_id("fc"), event.id or new_call_id(), event.name or "", "",
                                  "in_progress", self.namespaces)
            out.append(self.event("response.output_item.added", output_index=self.at,
                                  item=self.open))
        if event.arguments:
            self.open["arguments"] += event.arguments
            out.append(self.event("response.function_call_arguments.delta",
                                  item_id=self.open["id"], output_index=self.at,
                                  delta=event.arguments))
        return out

    @property
    def at(self) -> int:
        return len(self.items)

    def close(self, status: str) -> list[bytes]:
        item, at = self.open, self.at
        if item is None:
            return []
        self.open, self.key = None, None
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=at, content_index=0,
                                  text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"],
                                  output_index=at, content_index=0, text=part["text"],
                                  logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=at, content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=at, name=item["name"],
                                  arguments=item["arguments"]))
        item = {**item, "status": status}
        self.items.append(item)
        out.append(self.event("response.output_item.done", output_index=at, item=item))
        return out


class RelayedResponseRecorder:
    """Reads a Responses answer relayed from an upstream that serves the API itself (JSON, or
    SSE ending in ``response.completed``/``response.incomplete``) and hands its final response
    object to ``done`` -- for SSE before the chunk with that event is relayed, so it is kept
    before the client can chain on it. It never raises: an answer it cannot read is relayed
    all the same and simply not kept."""

    def __init__(self, stream: bool, done: Done, max_bytes: int = MAX_RECORDED_BYTES) -> None:
        self.stream, self.done, self.max_bytes = stream, done, max_bytes
        self._decoder = SSEDecoder(max_bytes) if stream else None
        self._body: list[bytes] | None = [] if not stream else None
        self._size = 0
        self._final: dict[str, Any] | None = None
        self._broken = False

    async def feed(self, chunk: bytes) -> None:
        if self._broken:
            return
        try:
            if self._decoder is not None:
                for event in self._decoder.feed(chunk):
                    self._event(event.data)
                if self._final is not None:
                    final, self._final = self._final, None
                    await self._keep(final)
            else:
                assert self._body is not None
                self._size += len(chunk)
                if self._size > self.max_bytes:
                    self._broken = True
                    return
                self._body.append(chunk)
        except Exception:  # a record we cannot read is not kept; the relay goes on
            self._broken = True

    async def end(self) -> None:
        if self._broken or self._body is None:
            return
        try:
            final = _response_of(json_io.loads(b"".join(self._body)))
        except ValueError:
            return
        if final is not None:
            await self._keep(final)

    async def _keep(self, final: dict[str, Any]) -> None:
        try:
            await self.done(final)
        except Exception:
            log.warning("a relayed response could not be kept for previous_response_id")

    def _event(self, data: str) -> None:
        if '"response.completed"' in data or '"response.incomplete"' in data:
            event = json_io.loads(data)
            if isinstance(event, dict) and event.get("type") in (
                    "response.completed", "response.incomplete"):
                self._final = _response_of(event.get("response"))


def _response_of(value: Any) -> dict[str, Any] | None:
    """A response object worth keeping: an id and a list of output items."""
    if isinstance(value, dict) and isinstance(value.get("id"), str) \
            and isinstance(value.get("output"), list) \
            and value.get("status") in ("completed", "incomplete"):
        return value
    return None

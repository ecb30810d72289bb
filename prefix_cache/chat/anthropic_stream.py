"""A turn's events as an Anthropic Message: one ``message`` object, or the SSE events
``message_start``, ``ping``, ``content_block_start`` / ``content_block_delta`` (text_delta,
input_json_delta) / ``content_block_stop``, ``message_delta`` (stop_reason, usage),
``message_stop``; an engine failure mid-stream ends it with an ``error`` event.

``stop_reason``: end_turn (the model ended its turn), max_tokens, stop_sequence (with the
``stop_sequence`` that matched), tool_use (the turn ends in tool calls). Usage follows
Anthropic's meaning: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those whose KV the engine restored (their sum is the prompt).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from .. import json_io
from ..http.errors import anthropic_error_body
from ..http.sse import sse_event
from .backend import BackendError, Usage
from .events import (
    Collected,
    Finish,
    OutputEvent,
    TextDelta,
    ToolCallDelta,
    TurnEnd,
    collect,
    new_call_id,
)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicUsage(BaseModel):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class AnthropicMessage(BaseModel):
    """The ``message`` object a Messages request is answered with (the OpenAPI document's)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]   # text and tool_use blocks
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(BaseModel):
    """``POST /v1/messages/count_tokens``'s answer."""

    input_tokens: int


@dataclass(frozen=True, slots=True)
class MessageMeta:
    """What a message says about itself before its first token."""

    id: str
    model: str
    input_tokens: int   # the prompt's length (message_start's usage)


def anthropic_usage(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def stop_reason(finish: Finish) -> tuple[str, str | None]:
    if finish.stop_sequence is not None:
        return "stop_sequence", finish.stop_sequence
    return STOP_REASONS.get(finish.reason, "end_turn"), None


def _input(call_id: str, arguments: str) -> Any:
    try:
        value = json_io.loads(arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise BackendError(f"the arguments of tool call {call_id} are not a JSON object")
    return value


def message_body(meta: MessageMeta, turn: Collected) -> dict[str, Any]:
    """A whole ``message`` object."""
    content: list[dict[str, Any]] = []
    if turn.text:
        content.append({"type": "text", "text": turn.text})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.id, c.arguments)}
                for c in turn.calls]
    reason, sequence = stop_reason(turn.finish)
    return {"id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": anthropic_usage(turn.finish.usage)}


async def message_json(meta: MessageMeta,
                       events: AsyncGenerator[OutputEvent, None]) -> dict[str, Any]:
    return message_body(meta, await collect(events))


async def message_stream(meta: MessageMeta,
                         events: AsyncGenerator[OutputEvent, None]) -> AsyncGenerator[bytes, None]:
    """The SSE events of a message."""
    yield _event("message_start", message={
        "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": meta.input_tokens, "output_tokens": 0}})
    yield _event("ping")
    blocks = _Blocks()
    end = TurnEnd()
    try:
        async with aclosing(end.content(events)) as content:  # closed with this stream
            async for event in content:
                for chunk in blocks.add(event):
                    yield chunk
    except BackendError as exc:  # the status is long sent: end the stream with the reason
        for chunk in blocks.close():
            yield chunk
        yield sse_event(anthropic_error_body(500, str(exc)), "error")
        return
    for chunk in blocks.close():
        yield chunk
    reason, sequence = stop_reason(end.finish)
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                 usage=anthropic_usage(end.finish.usage))
    yield _event("message_stop")


class _Blocks:
    """Content blocks opened and closed as the kind of event changes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: tuple[str, int] | None = None  # ("text", 0) or ("tool", call index)

    def add(self, event: TextDelta | ToolCallDelta) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, TextDelta):
            if self.open != ("text", 0):
                out += self._start(("text", 0), {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": event.text}))
            return out
        if self.open != ("tool", event.index):
            block = {"type": "tool_use", "id": event.id or new_call_id("toolu_"),
                     "name": event.name or "", "input": {}}
            out += self._start(("tool", event.index), block)
        if event.arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.arguments}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _start(self, kind: tuple[str, int], block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", index=self.index, content_block=block))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.index, delta=delta)


def _event(kind: str, **fields: Any) -> bytes:
    return sse_event({"type": kind, **fields}, kind)

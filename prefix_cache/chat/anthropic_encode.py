"""A turn's events as an Anthropic Message: one ``message`` object, or the SSE events
``message_start``, ``ping``, ``content_block_start`` / ``content_block_delta`` (thinking_delta,
text_delta, input_json_delta) / ``content_block_stop``, ``message_delta`` (stop_reason, usage),
``message_stop``; an engine failure mid-stream ends it with an ``error`` event.

The model's reasoning is a ``thinking`` block before the answer's (its ``signature`` empty: the
engine signs nothing, and a client's thinking blocks sent back are not rendered).

``stop_reason``: end_turn (the model ended its turn), max_tokens, stop_sequence (with the
``stop_sequence`` that matched), tool_use (the turn ends in tool calls). Usage follows
Anthropic's meaning: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those whose KV the engine restored (their sum is the prompt).
What is reported is what was reused and computed, never the boundary: ``message_start`` has
the input side as known then -- the engine's own counts once it has prefilled
(``Prefilled``), else what the server knew before generating (``MessageMeta.usage``: the
prompt's length, nothing claimed as read) -- and ``message_delta`` has the final counts (the
engine's, or the upstream's usage at the end), which the SDKs' final message keeps.

A tool call whose arguments are not a JSON object (a small model's ``{path: a.txt``) is not a
``tool_use`` block the client could not read: it comes back as the text it was (``{"name":
..., "arguments": ...}``), as the in-process engine returns a call it cannot parse, and a turn
left without tool calls ends with end_turn. So a stream holds each call until it is whole,
then sends it as one ``input_json_delta``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from ..engine.protocol import BackendError, Usage
from ..http.errors import anthropic_error_body
from ..http.sse import sse_event
from ..util import json_io
from .events import (
    Collected,
    CollectedCall,
    Finish,
    OutputEvent,
    ReasoningDelta,
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
    usage: Usage    # the prompt's counts as known before generating (completion_tokens 0)


def anthropic_usage(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def stop_reason(finish: Finish, tool_calls: bool = True) -> tuple[str, str | None]:
    """Anthropic's stop reason and sequence (``tool_calls``: whether any call came back as a
    tool_use block; a turn whose calls all became text ended its turn)."""
    if finish.stop_sequence is not None:
        return "stop_sequence", finish.stop_sequence
    if finish.reason == "tool_calls" and not tool_calls:
        return "end_turn", None
    return STOP_REASONS.get(finish.reason, "end_turn"), None


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the object a tool_use block holds; None when they are not one."""
    try:
        value = json_io.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def call_text(call: CollectedCall) -> str:
    """A call that is no tool_use block, as the text the model wrote for it."""
    return f'{{"name": {json_io.dumps(call.name).decode()}, "arguments": {call.arguments}}}'


def message_body(meta: MessageMeta, turn: Collected) -> dict[str, Any]:
    """A whole ``message`` object."""
    text, blocks = turn.text, []
    thinking = ([{"type": "thinking", "thinking": turn.reasoning, "signature": ""}]
                if turn.reasoning else [])
    for call in turn.calls:
        value = tool_input(call.arguments)
        if value is None:
            text += call_text(call)
        else:
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": value})
    content = [{"type": "text", "text": text}] if text else []
    reason, sequence = stop_reason(turn.finish, bool(blocks))
    return {"id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
            "content": thinking + content + blocks, "stop_reason": reason,
            "stop_sequence": sequence, "usage": anthropic_usage(turn.finish.usage)}


async def message_json(meta: MessageMeta,
                       events: AsyncGenerator[OutputEvent, None]) -> dict[str, Any]:
    return message_body(meta, await collect(events))


async def message_stream(meta: MessageMeta,
                         events: AsyncGenerator[OutputEvent, None]) -> AsyncGenerator[bytes, None]:
    """The SSE events of a message: ``message_start`` once the engine has prefilled (its
    first piece, or the end, has come), so its usage is the engine's own where it tells it."""
    blocks = _Blocks()
    end = TurnEnd()
    started: Usage | None = None
    try:
        async with aclosing(end.content(events)) as content:  # closed with this stream
            async for event in content:
                if started is None:
                    started = _input_usage(meta, end)
                    yield _start(meta, started)
                for chunk in blocks.add(event):
                    yield chunk
            if started is None:
                started = _input_usage(meta, end)
                yield _start(meta, started)
    except BackendError as exc:  # the status is long sent: end the stream with the reason
        if started is None:
            yield _start(meta, meta.usage)
        for chunk in blocks.close():
            yield chunk
        yield sse_event(anthropic_error_body(500, str(exc)), "error")
        return
    for chunk in blocks.close():
        yield chunk
    reason, sequence = stop_reason(end.finish, blocks.tool_uses > 0)
    final = end.finish.usage  # the engine's or the upstream's own counts, at the end
    usage = Usage(final.prompt_tokens or started.prompt_tokens, final.completion_tokens,
                  final.cached_tokens if final.prompt_tokens else started.cached_tokens)
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                 usage=anthropic_usage(usage))
    yield _event("message_stop")


def _input_usage(meta: MessageMeta, end: TurnEnd) -> Usage:
    return meta.usage if end.prefilled is None else end.prefilled.usage


def _start(meta: MessageMeta, usage: Usage) -> bytes:
    start = _event("message_start", message={
        "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": anthropic_usage(Usage(usage.prompt_tokens, 0, usage.cached_tokens))})
    return start + _event("ping")


class _Blocks:
    """Content blocks opened and closed as the kind of event changes; a tool call is held
    until it is whole, then sent as a tool_use block, or as text if it is not one."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None            # "thinking", "text" or "tool"
        self.call: CollectedCall | None = None  # the call being held
        self.call_index: int | None = None
        self.tool_uses = 0

    def add(self, event: TextDelta | ReasoningDelta | ToolCallDelta) -> list[bytes]:
        if isinstance(event, TextDelta):
            return self._flush_call() + self._text(event.text)
        if isinstance(event, ReasoningDelta):
            out = self._flush_call()
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""})
            return out + [self._delta({"type": "thinking_delta", "thinking": event.text})]
        out: list[bytes] = []
        if self.call is None or self.call_index != event.index:
            out += self._flush_call()
            self.call = CollectedCall(event.id or new_call_id("toolu_"), event.name or "")
            self.call_index = event.index
        self.call.arguments += event.arguments
        return out

    def close(self) -> list[bytes]:
        return self._flush_call() + self._close_block()

    def _flush_call(self) -> list[bytes]:
        call, self.call, self.call_index = self.call, None, None
        if call is None:
            return []
        if tool_input(call.arguments) is None:
            return self._text(call_text(call))
        self.tool_uses += 1
        out = self._start("tool", {"type": "tool_use", "id": call.id, "name": call.name,
                                   "input": {}})
        out.append(self._delta({"type": "input_json_delta",  # as written: big ints exact
                                "partial_json": call.arguments or "{}"}))
        return out + self._close_block()

    def _text(self, text: str) -> list[bytes]:
        out = [] if self.open == "text" else self._start("text", {"type": "text", "text": ""})
        out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def _close_block(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close_block()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", index=self.index, content_block=block))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.index, delta=delta)


def _event(kind: str, **fields: Any) -> bytes:
    return sse_event({"type": kind, **fields}, kind)

"""A turn's events as OpenAI chat completions: one ``chat.completion``, or SSE
``chat.completion.chunk`` events ending in ``data: [DONE]``. Tool calls the engine cut out of
its text are ``tool_calls`` (whole, one chunk each), with finish reason "tool_calls". The
model's reasoning is ``message.reasoning_content`` (streamed as ``delta.reasoning_content``),
as vLLM sends it; a turn without reasoning has no such field.

``usage.prompt_tokens_details.cached_tokens`` reports the prompt tokens whose KV the engine
restored. A stream that breaks after it started ends with an ``error`` object and no
``[DONE]``; a whole answer that fails is a 500 (``chat.respond``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from ..engine.protocol import BackendError, Usage
from ..http.errors import error_body
from ..util import json_io
from .events import Events, Finish, ReasoningDelta, TextDelta, ToolCallDelta, collect


@dataclass(frozen=True, slots=True)
class ChatMeta:
    """What a completion says besides its content."""

    model: str
    include_usage: bool = False    # a stream's usage chunk (``stream_options.include_usage``)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def usage_body(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage(0, 0)
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _call(call_id: str, name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    return {**out, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


async def completion_json(meta: ChatMeta, events: Events) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    turn = await collect(events)
    message: dict[str, Any] = {"role": "assistant", "content": turn.text}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.calls:
        message["tool_calls"] = [_call(c.id, c.name, c.arguments) for c in turn.calls]
    return {
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": turn.finish.reason}],
        "usage": usage_body(turn.finish.usage),
    }


async def completion_stream(meta: ChatMeta, events: Events) -> AsyncIterator[bytes]:
    """SSE events: ``data: {chat.completion.chunk}`` ... ``data: [DONE]``."""
    base = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
            "model": meta.model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _event({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                            "finish_reason": finish}]})

    finish = Finish("length")
    yield chunk({"role": "assistant", "content": ""})
    try:
        async with aclosing(events):
            async for event in events:
                if isinstance(event, TextDelta):
                    yield chunk({"content": event.text})
                elif isinstance(event, ReasoningDelta):
                    yield chunk({"reasoning_content": event.text})
                elif isinstance(event, ToolCallDelta):  # whole calls, one per event
                    yield chunk({"tool_calls": [_call(event.id or "", event.name or "",
                                                      event.arguments, event.index)]})
                elif isinstance(event, Finish):
                    finish = event
    except BackendError as exc:  # the status is long sent: end the stream with the reason
        yield _event(error_body(str(exc), "server_error", "engine_error"))
        return
    yield chunk({}, finish.reason)
    if meta.include_usage:
        yield _event({**base, "choices": [], "usage": usage_body(finish.usage)})
    yield b"data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json_io.dumps(data) + b"\n\n"

"""An upstream's chat completion (one ``chat.completion``, or SSE ``chat.completion.chunk``
events) as the neutral events the agent APIs format: the answer of an upstream that speaks only
chat completions, converted back.

Text and tool calls are read from ``choices[0]``; the finish reason and usage from the last
chunks (the sidecar asks for usage with ``stream_options.include_usage``); vLLM's ``stop_reason``
names the stop string that matched. Reasoning is read from ``reasoning_content`` (vLLM's, the
engine's) or ``reasoning`` (mlx_lm.server's); logprobs are not carried over. A broken stream
raises ``BackendError``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import httpx

from ..engine.protocol import BackendError, Usage
from ..http.sse import EventStreamError, SSEDecoder
from ..util import json_io
from .events import Finish, OutputEvent, ReasoningDelta, TextDelta, ToolCallDelta

MAX_COMPLETION_BYTES = 64 << 20
FINISH_REASONS = ("stop", "length", "tool_calls")


class _Answer:
    """The finish reason, usage and stop string, as the chunks tell them."""

    def __init__(self, prompt_tokens: int) -> None:
        self.reason: str | None = None
        self.usage = Usage(prompt_tokens, 0)
        self.stop: str | None = None

    def read(self, data: dict[str, Any]) -> dict[str, Any]:
        """The first choice of a chunk or completion (``{}`` if none); notes what ends it."""
        usage = data.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            self.usage = Usage(_count(usage.get("prompt_tokens")),
                               _count(usage.get("completion_tokens")),
                               _count(details.get("cached_tokens") if isinstance(details, dict)
                                      else 0))
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        if not isinstance(choice, dict):
            raise BackendError("the upstream sent a choice that is not an object")
        if isinstance(choice.get("finish_reason"), str):
            self.reason = choice["finish_reason"]
        if isinstance(choice.get("stop_reason"), str):
            self.stop = choice["stop_reason"]
        return choice

    def finish(self) -> Finish:
        reason = self.reason if self.reason in FINISH_REASONS else "stop"
        stop = self.stop if reason == "stop" else None
        return Finish(reason, self.usage, stop)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _calls(value: Any) -> list[ToolCallDelta]:
    calls = []
    for position, call in enumerate(value if isinstance(value, list) else []):
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        index = call.get("index", position)
        arguments = function.get("arguments")
        calls.append(ToolCallDelta(
            index=index if isinstance(index, int) else position,
            id=call.get("id") if isinstance(call.get("id"), str) else None,
            name=function.get("name") if isinstance(function.get("name"), str) else None,
            arguments=arguments if isinstance(arguments, str) else
            ("" if arguments is None else json_io.dumps(arguments).decode())))
    return calls


async def completion_events(response: httpx.Response, *, stream: bool,
                            prompt_tokens: int) -> AsyncGenerator[OutputEvent, None]:
    """The events of an open upstream response (closed when the events end or are closed)."""
    answer = _Answer(prompt_tokens)
    try:
        if stream:
            async for event in _stream(response, answer):
                yield event
        else:
            message = answer.read(await _whole(response)).get("message")
            message = message if isinstance(message, dict) else {}
            if thought := _reasoning(message):
                yield ReasoningDelta(thought)
            if isinstance(message.get("content"), str) and message["content"]:
                yield TextDelta(message["content"])
            for call in _calls(message.get("tool_calls")):
                yield call
        yield answer.finish()
    finally:
        await response.aclose()


async def _whole(response: httpx.Response) -> dict[str, Any]:
    body = b""
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_COMPLETION_BYTES:
                raise BackendError("the upstream's completion is too large")
    except httpx.HTTPError as exc:
        raise BackendError(f"the upstream failed mid-answer ({type(exc).__name__})") from exc
    return _json_object(body, "the upstream's completion is")


async def _stream(response: httpx.Response,
                  answer: _Answer) -> AsyncGenerator[OutputEvent, None]:
    decoder = SSEDecoder()
    try:
        async for chunk in response.aiter_bytes():
            for event in decoder.feed(chunk):
                if event.data.strip() == "[DONE]":
                    return
                for out in _chunk_events(event.data, answer):
                    yield out
    except httpx.HTTPError as exc:
        raise BackendError(f"the upstream failed mid-stream ({type(exc).__name__})") from exc
    except EventStreamError as exc:
        raise BackendError(f"the upstream's stream is broken: {exc}") from exc


def _chunk_events(data: str, answer: _Answer) -> list[OutputEvent]:
    chunk = _json_object(data, "the upstream sent an event that is")
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise BackendError(f"the upstream failed mid-stream: {message}")
    delta = answer.read(chunk).get("delta")
    delta = delta if isinstance(delta, dict) else {}
    out: list[OutputEvent] = []
    if thought := _reasoning(delta):
        out.append(ReasoningDelta(thought))
    if isinstance(delta.get("content"), str) and delta["content"]:
        out.append(TextDelta(delta["content"]))
    out.extend(_calls(delta.get("tool_calls")))
    return out


def _reasoning(message: dict[str, Any]) -> str:
    """A message's or delta's reasoning text, under either name a server sends it by."""
    for name in ("reasoning_content", "reasoning"):
        if isinstance(message.get(name), str) and message[name]:
            return str(message[name])
    return ""


def _json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """``text`` parsed; BackendError "<what> not JSON" / "not a JSON object" otherwise."""
    try:
        data = json_io.loads(text)
    except ValueError as exc:
        raise BackendError(f"{what} not JSON") from exc
    if not isinstance(data, dict):
        raise BackendError(f"{what} not a JSON object")
    return data

"""An upstream's answer, relayed byte for byte, read on the way for what the request cost:
when each piece of its content comes (TTFT, inter-token latency), the token counts of its
``usage`` and why it finished, in any of the three APIs' shapes (chat completions, Anthropic
Messages, OpenAI Responses), streamed or whole.

Only what it needs is parsed: an SSE ``data:`` line that names ``usage`` or a finish reason (a
line is read once it is whole), or a whole JSON body (up to ``MAX_JSON_BYTES``). It never changes or
holds back a byte.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from .relay import RelayTap
from .request_record import RequestRecord

MAX_JSON_BYTES = 4 * 1024 * 1024   # a larger whole answer is relayed, its usage not read
MAX_LINE_BYTES = 1024 * 1024       # an SSE line longer than this is not parsed
# What only an event carrying answer content holds, in each API's stream (a chat stream's
# first chunk, the role with empty content, does not count).
CONTENT = re.compile(rb'"content":\s*"[^"]|"tool_calls":\s*\[\s*\{|"content_block_delta"'
                     rb'|\.delta"')


# What only an event that says why the answer ended holds.
FINISH = re.compile(rb'"finish_reason":\s*"|"stop_reason":\s*"|"response\.(completed|incomplete)"')
# Each API's reasons as OpenAI's chat completions name them (the finished_reason label).
ANTHROPIC_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                     "tool_use": "tool_calls", "pause_turn": "stop", "refusal": "stop"}


def finish_reason(event: Any) -> str | None:
    """Why an answer (or its last stream event) ended, as chat completions names it."""
    if not isinstance(event, dict):
        return None
    choices = event.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return reason if isinstance(reason, str) else None
    for holder in (event, event.get("delta"), event.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("stop_reason"), str):
            return ANTHROPIC_REASONS.get(holder["stop_reason"], "stop")
    response = event.get("response", event)
    if isinstance(response, dict) and response.get("object") == "response":
        status = response.get("status")
        if status == "completed":
            calls = any(isinstance(i, dict) and i.get("type") == "function_call"
                        for i in response.get("output") or ())
            return "tool_calls" if calls else "stop"
        if status == "incomplete":
            return "length"
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_counts(usage: Any) -> tuple[int | None, int | None, int | None]:
    """(prompt, cached, generated) from a usage object of any of the three APIs."""
    if not isinstance(usage, dict):
        return None, None, None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    if "prompt_tokens" in usage:  # chat completions
        return _int(usage["prompt_tokens"]), cached, _int(usage.get("completion_tokens"))
    prompt = _int(usage.get("input_tokens"))
    read = _int(usage.get("cache_read_input_tokens"))
    if read is not None:  # Anthropic: input_tokens leaves out what was read from the cache
        cached = read
        prompt = (prompt or 0) + read + (_int(usage.get("cache_creation_input_tokens")) or 0)
    return prompt, cached, _int(usage.get("output_tokens"))


def find_usage(event: Any) -> Any:
    """The usage object of an answer or stream event (Messages and Responses nest it)."""
    if not isinstance(event, dict):
        return None
    if "usage" in event:
        return event["usage"]
    for outer in ("message", "response"):
        inner = event.get(outer)
        if isinstance(inner, dict) and "usage" in inner:
            return inner["usage"]
    return None


class UsageTap:
    """A ``RelayTap`` that notes a relayed answer's first content and usage in ``record``,
    then passes each chunk on to ``inner`` (the relay's own tap, if any)."""

    def __init__(self, record: RequestRecord, streamed: bool,
                 inner: RelayTap | None = None) -> None:
        self.record = record
        self.streamed = streamed
        self.inner = inner
        self._buffer = bytearray()

    async def feed(self, chunk: bytes) -> None:
        if self.streamed:
            self._stream(chunk)
        elif len(self._buffer) + len(chunk) <= MAX_JSON_BYTES:
            self._buffer += chunk
        if self.inner is not None:
            await self.inner.feed(chunk)

    async def end(self) -> None:
        if not self.streamed and self._buffer:
            self._note(bytes(self._buffer))
        self._buffer.clear()
        if self.inner is not None:
            await self.inner.end()

    def _stream(self, chunk: bytes) -> None:
        """Whole ``data:`` lines only: a chunk may end anywhere."""
        self._buffer += chunk
        if b"\n" not in chunk:
            if len(self._buffer) > MAX_LINE_BYTES:
                self._buffer.clear()  # a line too long to be worth reading
            return
        *lines, rest = bytes(self._buffer).split(b"\n")
        self._buffer = bytearray(rest)
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            if CONTENT.search(line):
                self.record.content()
            if b'"usage"' in line or FINISH.search(line):
                self._note(line[5:])

    def _note(self, data: bytes) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        prompt, cached, generated = usage_counts(find_usage(event))
        if self.record.prompt_tokens and prompt == 0 and event.get("type") == "message_delta":
            prompt = None  # Anthropic's closing event repeats no input count worth taking
        self.record.usage(prompt, cached, generated)
        self.record.finish_reason = finish_reason(event) or self.record.finish_reason

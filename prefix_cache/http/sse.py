"""Server-sent events both ways: one event as bytes, and a decoder of a byte stream into events.

The decoder follows the EventSource rules that matter for JSON APIs: lines end in LF, CRLF or
CR; ``event:`` names an event, ``data:`` lines are joined with LF, a blank line dispatches,
comments (``:``) are skipped. It holds at most one unfinished event, bounded by ``max_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

MAX_EVENT_BYTES = 16 << 20  # one event larger than this is a broken upstream, not an answer


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One event: ``event: NAME`` (when named) and ``data: JSON``."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


@dataclass(frozen=True, slots=True)
class Event:
    event: str | None
    data: str


class EventStreamError(ValueError):
    """The stream is not a sequence of events (one too large to hold)."""


class SSEDecoder:
    """Bytes in, complete events out."""

    def __init__(self, max_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buffer = b""
        self._event: str | None = None
        self._data: list[str] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[Event]:
        """The events ``chunk`` completes."""
        self._buffer += chunk
        events: list[Event] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                break
            end, width = cut
            line = self._buffer[:end].decode("utf-8", "replace")
            self._buffer = self._buffer[end + width:]
            event = self._line(line)
            if event is not None:
                events.append(event)
        if len(self._buffer) + self._size > self.max_bytes:
            raise EventStreamError(f"an event is larger than {self.max_bytes} bytes")
        return events

    def _line(self, line: str) -> Event | None:
        if not line:
            if not self._data and self._event is None:
                return None
            event = Event(self._event, "\n".join(self._data))
            self._event, self._data, self._size = None, [], 0
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
            self._size += len(value)
        return None


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """Where the first line of ``buffer`` ends and how long its end is; None if unfinished (a
    CR at the very end may be the first half of a CRLF)."""
    lf, cr = buffer.find(b"\n"), buffer.find(b"\r")
    if cr < 0 or (0 <= lf < cr):
        return None if lf < 0 else (lf, 1)
    if cr + 1 == len(buffer):
        return None
    return (cr, 2) if buffer[cr + 1:cr + 2] == b"\n" else (cr, 1)

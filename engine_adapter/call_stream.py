"""Tool calls written under a grammar, streamed as they are written: text deltas in; text,
and each call in pieces (its id and name first, then its arguments as they come), out.

The grammar (``grammar.build``) writes a call as ``START{"name": "<name>", "arguments":
<JSON>}END`` with Python's separators (a newline may stand inside the markers), so once ``{"name": "...", "arguments": `` is read the
call's name is known and everything up to the wrapper's closing brace is its arguments. What
could still be the wrapper's brace or the start of END is held until the next delta tells.
A call cut off by ``max_tokens`` ends with the arguments written so far (the turn's finish
reason says "length").
"""

from __future__ import annotations

import json
import re

from prefix_cache.engine.protocol import ToolCallChunk

from .grammar.build import Envelope
from .tool_calls import _partial_suffix, new_call_id

Piece = str | ToolCallChunk
HEAD = re.compile(r'\s*\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


class StreamedCalls:
    """Text deltas in; text and tool-call pieces out, in order."""

    def __init__(self, envelope: Envelope) -> None:
        self.start, self.end = envelope.start, envelope.end
        self.calls = 0              # calls begun so far
        self._buffer = ""
        self._state = "text"        # "text", "head" (reading the name) or "arguments"

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        """What can be passed on now; at ``final`` everything held is released."""
        out: list[Piece] = []
        self._buffer += text
        while True:
            step = getattr(self, f"_{self._state}")(out, final)
            if not step:
                break
        return [piece for piece in out if piece != ""]

    def _text(self, out: list[Piece], final: bool) -> bool:
        cut = self._buffer.find(self.start)
        if cut < 0:
            keep = 0 if final else _partial_suffix(self._buffer, self.start)
            out.append(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        out.append(self._buffer[:cut])
        self._buffer = self._buffer[cut + len(self.start):]
        self._state = "head"
        return True

    def _head(self, out: list[Piece], final: bool) -> bool:
        match = HEAD.match(self._buffer)
        if match is None:
            if final or self.end in self._buffer:  # not the grammar's shape: as text
                out.append(self.start + self._buffer)
                self._buffer, self._state = "", "text"
                return not final
            return False
        out.append(ToolCallChunk(self.calls, new_call_id(), json.loads(f'"{match[1]}"')))
        self._buffer = self._buffer[match.end():]
        self._state = "arguments"
        return True

    def _arguments(self, out: list[Piece], final: bool) -> bool:
        index = self.calls
        cut = self._buffer.find(self.end)
        if cut >= 0:
            body = self._buffer[:cut].rstrip()
            body = body[:-1] if body.endswith("}") else body
            if body:
                out.append(ToolCallChunk(index, arguments=body))
            self._buffer, self._state = self._buffer[cut + len(self.end):], "text"
            self.calls += 1
            return True
        if final:
            if self._buffer:
                out.append(ToolCallChunk(index, arguments=self._buffer))
            self._buffer = ""
            self.calls += 1
            return False
        # Held: a partial END, whitespace before it, and the wrapper's closing brace, perhaps.
        safe = self._buffer[:len(self._buffer) - _partial_suffix(self._buffer, self.end)]
        safe = safe.rstrip()
        safe = safe[:-1] if safe.endswith("}") else safe
        if safe:
            out.append(ToolCallChunk(index, arguments=safe))
        self._buffer = self._buffer[len(safe):]
        return False

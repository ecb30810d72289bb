"""Tool calls out of generated text, with the model family's own parser (``families``).

mlx-lm's ``TokenizerWrapper`` knows, per template family, the markers a model writes a tool call
between (``<tool_call>`` ... ``</tool_call>`` for Qwen/Hermes, ``[TOOL_CALLS]`` to the end for
Mistral, ...) and a parser for what is inside; ``call_parsers`` adds Llama 3.x and DeepSeek. ``ToolCallSplitter`` cuts a stream of text deltas
at those markers: text outside them passes on (a partial marker at the end of a delta is held
until the next one tells), each complete call becomes a ``ToolCall``. A call the parser cannot
read, or one cut off by ``max_tokens``, passes on as the text it was, markers included, so
nothing the model wrote is lost. Calls are parsed only for requests that give tools.

A model whose template names no tool-call format gets the engine's envelope (``<tool_call>``
JSON ``</tool_call>``, what the demo model's template asks for), written under a grammar
(``engine_adapter.grammar``); calls written under a grammar are streamed as they are written
(``call_stream``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefix_cache.engine.protocol import ToolCall, ToolCallChunk
from prefix_cache.render.render import unwrap_tokenizer

from .families import NATIVE, NOT_CONSTRAINED, CallFormat, call_format, forced_calls
from .grammar.build import ENGINE_ENVELOPE, LLAMA_ENVELOPE, Envelope

log = logging.getLogger("engine_adapter.tool_calls")

Parser = Callable[[str, Any], Any]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallSplitter:
    """Text deltas in; text and tool calls out, in order."""

    def __init__(self, start: str, end: str, parse: Parser,
                 tools: Sequence[Mapping[str, Any]] | None) -> None:
        self.start, self.end, self.parse, self.tools = start, end, parse, tools
        self._pending = ""
        self._in_call = False
        self.calls = 0

    @classmethod
    def for_format(cls, fmt: CallFormat | None,
                   tools: Sequence[Mapping[str, Any]] | None) -> ToolCallSplitter | None:
        """The splitter of a family's call format (``families.call_format``, read once per
        tokenizer), or None when it has none or the request gives no tools."""
        if not tools or fmt is None:
            return None
        return cls(fmt.start, fmt.end, fmt.parse, tools)

    def feed(self, text: str, final: bool = False) -> list[str | ToolCall]:
        """What can be passed on now; at ``final`` everything held is released."""
        out: list[str | ToolCall] = []
        buffer = self._pending + text
        self._pending = ""
        while buffer:
            if not self._in_call:
                cut = buffer.find(self.start)
                if cut < 0:
                    keep = 0 if final else _partial_suffix(buffer, self.start)
                    out.append(buffer[:len(buffer) - keep])
                    self._pending = buffer[len(buffer) - keep:]
                    break
                out.append(buffer[:cut])
                buffer = buffer[cut + len(self.start):]
                self._in_call = True
                continue
            cut = buffer.find(self.end) if self.end else -1
            if cut < 0:
                if final:
                    out += self._call(buffer, closed=not self.end)
                else:
                    self._pending = buffer
                break
            out += self._call(buffer[:cut], closed=True)
            buffer = buffer[cut + len(self.end):]
        if final and self._in_call:  # a call still open at the end, with nothing after it
            out += self._call("", closed=not self.end)
        return [piece for piece in out if piece != ""]

    def _call(self, body: str, closed: bool) -> list[str | ToolCall]:
        self._in_call = False
        raw = self.start + body + (self.end if closed else "")
        if not closed:
            return [raw]
        try:
            parsed = self.parse(body, self.tools)
        except Exception as exc:  # a model's malformed call is its text, not an error
            log.info("a tool call could not be parsed (%s); returned as text", exc)
            return [raw]
        calls = parsed if isinstance(parsed, list) else [parsed]
        out: list[str | ToolCall] = []
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return [raw]
            arguments = call.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            call_id = call.get("id")
            out.append(ToolCall(call_id if isinstance(call_id, str) and call_id
                                else new_call_id(), call["name"], arguments))
        self.calls += len(out)
        return out


class CallGaps:
    """Pieces in, the same out without the whitespace between and after tool calls (the
    template's newlines around its markers): a call stands next to a call or to text, never a
    blank text block. Whitespace that text follows is kept with it."""

    def __init__(self) -> None:
        self._seen = False     # a call has passed
        self._held = ""

    def __call__(self, pieces: list[Any], final: bool) -> list[Any]:
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                if self._seen and not (self._held + piece).strip():
                    self._held += piece
                    continue
                piece, self._held = self._held + piece, ""
            elif isinstance(piece, (ToolCall, ToolCallChunk)):   # a call, or a piece of one
                self._seen, self._held = True, ""
            out.append(piece)
        if final:
            self._held = ""
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that ``marker`` starts with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def json_envelope(tokenizer: Any) -> Envelope | None:
    """The envelope a grammar writes this model's forced tool calls in
    (``families.forced_calls``): its family's markers when its parser reads JSON ``{"name",
    "arguments"}`` between them (mlx-lm's ``json_tools``), none for Llama 3.x's bare JSON, the engine's own when it has no
    format or one of this project's, None when its format is another (not constrained)."""
    fmt = call_format(tokenizer)
    how = forced_calls(fmt.name if fmt else None)
    if how == NOT_CONSTRAINED:
        return None
    if fmt is not None and fmt.name == "llama3_json":
        return LLAMA_ENVELOPE
    start, end = ((fmt.start, fmt.end) if how == NATIVE and fmt is not None
                  else (ENGINE_ENVELOPE.start, ENGINE_ENVELOPE.end))
    return Envelope(start, end, (added_token(tokenizer, start), added_token(tokenizer, end)))


def marker_ids(tokenizer: Any, fmt: CallFormat | None) -> tuple[int, ...]:
    """The ids of the format's markers that are single added tokens of the vocabulary."""
    ids = (added_token(tokenizer, m) for m in (fmt.markers if fmt else ()))
    return tuple(i for i in ids if i is not None)


def added_token(tokenizer: Any, marker: str) -> int | None:
    """The id of ``marker`` when it is one added token of the vocabulary, else None."""
    inner = unwrap_tokenizer(tokenizer)
    added = getattr(inner, "get_added_vocab", None)
    return added().get(marker) if callable(added) else None

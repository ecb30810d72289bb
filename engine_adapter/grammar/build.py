"""A request's binding output fields as one llguidance Lark grammar, each bad or unsupported
part an ``InvalidRequestError`` naming it.

    response_format json_object / json_schema   start: %json {schema}
    tool_choice "required" / a named function   start: call+  (call, when not parallel)
    tool_choice "auto" (tools given)            start: reasoning? TEXT? call*   (or the format)
    call:  START NL? (args_0 | args_1 | ...) NL? END
           args_i: %json {"name": const, "arguments": ...}

A call's envelope (START, END) is the model family's where its parser reads JSON
``{"name", "arguments"}`` between two markers (mlx-lm's ``json_tools``), none for Llama 3.x
(``{"name", "parameters"}`` as the whole reply, one call: ``call: args_0 | ...``; under
``auto`` no grammar), and the engine's own (``<tool_call>``, ``</tool_call>``) where the
template names no format. With ``auto`` a reply is
text (a reasoning block, a sentence), then calls, either optional: the text may not hold START,
so a call, once started, is finished under its tool's schema. JSON is written as Python's ``json.dumps``
writes it (", " and ": ", no other whitespace), what chat templates show the model, and no
whitespace run can eat the token budget.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefix_cache.engine.protocol import OutputConstraints
from prefix_cache.errors import InvalidRequestError

UNSUPPORTED = "unsupported_parameter"
# How %json writes: python's separators, no free whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Envelope:
    """The markers a tool call's JSON is written between; ``ids``: each marker's token id when
    it is one added token of the vocabulary (Qwen's ``<tool_call>``), which the grammar names
    by id: as text the tokenizer would never write it."""

    start: str
    end: str
    ids: tuple[int | None, int | None] = (None, None)
    arguments: str = "arguments"   # the key the call's arguments go under

    @property
    def bare(self) -> bool:
        """No markers: the call is the whole reply, one call (Llama 3.x's JSON calls)."""
        return not self.start


ENGINE_ENVELOPE = Envelope("<tool_call>", "</tool_call>")
# Llama 3.1/3.2/3.3: {"name": "f", "parameters": {...}} as the whole reply, one call a turn.
LLAMA_ENVELOPE = Envelope("", "", arguments="parameters")


@dataclass(frozen=True, slots=True)
class OutputGrammar:
    """A request's grammar; ``parts`` names each ``%json`` schema by the request field it
    came from (to say which one a compile error is in)."""

    lark: str
    parts: tuple[tuple[str, str], ...]   # (field name, the grammar of that part alone)
    calls: bool                          # whether tool calls may come (then parsed out)


def output_grammar(constraints: OutputConstraints, tools: Sequence[Mapping[str, Any]] | None,
                   envelope: Envelope | None,
                   think: Envelope | None = None) -> OutputGrammar | None:
    """The grammar the output must follow, or None when nothing binds it; ``think``: the
    model's reasoning markers, a block of which may come first under ``auto``."""
    fmt = _format_schema(constraints.response_format)
    choice = constraints.tool_choice or "auto"
    if choice not in ("auto", "none") and not tools:
        raise InvalidRequestError("tool_choice needs tools", code=UNSUPPORTED)
    choice = choice if tools else "none"
    chosen = _chosen_tools(choice, tools or ())
    if envelope is not None and envelope.bare and choice == "auto" and fmt is None:
        return None   # a bare call is told from text only after it: the family's parser reads it
    if chosen and envelope is None:
        if choice == "auto" and fmt is None:
            return None  # the family's own parser reads its calls, unconstrained
        raise InvalidRequestError("tool_choice is not supported for this model: its template's "
                                  "tool-call format cannot be constrained", code=UNSUPPORTED)
    rules: list[str] = []
    parts: list[tuple[str, str]] = []
    alternatives: list[str] = []
    if chosen and envelope is not None:
        names = []
        for index, tool in chosen:
            name = f"args_{index}"
            body = f"{name}: %json {_dumps(_call_schema(tool, envelope.arguments))}"
            rules.append(body)
            parts.append((f"tools[{index}].function.parameters", f"start: {name}\n{body}"))
            names.append(name)
        start_id, end_id = envelope.ids
        if envelope.bare:
            rules.append(f"call: {' | '.join(names)}")
        else:
            # A newline may stand inside the markers: Qwen/Hermes templates show calls so.
            rules.append(f"call: {_marker(envelope.start, start_id)} body")
            rules.append(f"body: NL? ({' | '.join(names)}) NL? {_marker(envelope.end, end_id)}")
            rules.append('NL: "\\n"')
        parallel = constraints.parallel_tool_calls and not envelope.bare
        alternatives.append("call+" if parallel else "call")
    if choice in ("auto", "none") or not chosen:
        if fmt is not None:
            rules.append(f"answer: %json {_dumps(fmt[1])}")
            parts.append((fmt[0], f"start: answer\n{rules[-1]}"))
            alternatives.insert(0, "answer")
        elif alternatives and envelope is not None and not envelope.bare:
            alternatives = [_text_then_calls(envelope, think, rules,
                                             constraints.parallel_tool_calls)]
    if not alternatives:
        return None
    start_rule = "start: " + " | ".join(alternatives)
    return OutputGrammar("\n".join([start_rule, *rules]), tuple(parts), bool(chosen))


def _text_then_calls(envelope: Envelope, think: Envelope | None, rules: list[str],
                     parallel: bool) -> str:
    """``auto``'s start (its lexemes added to ``rules``): a reasoning block, text that never
    holds START, then calls; each optional. Where START is text, not one token, the text before
    the first call is one lexeme with START (``OPEN``): as two, the text lexeme would take
    START's first characters and the call could never start."""
    more = "call*" if parallel else ""
    head = ""
    if think is not None:   # its markers are tokens the text lexemes cannot write
        rules.append(f"reasoning: {_marker(think.start, think.ids[0])}? THOUGHT? "
                     f"{_marker(think.end, think.ids[1])}")
        rules.append(f"THOUGHT: {_text_without(think.end, envelope.start)}")
        head = "reasoning? "
    rules.append(f"TEXT: {_text_without(envelope.start)}")
    if envelope.ids[0] is not None:
        return f"{head}TEXT? {'call*' if parallel else 'call?'}"
    rules.append(f"OPEN: ({_text_without(envelope.start)}) {json.dumps(envelope.start)}")
    return f"{head}TEXT? | {head}(OPEN | {_marker(envelope.start, None)}) body {more}"


def _format_schema(response_format: Mapping[str, Any] | None) -> tuple[str, Any] | None:
    """(field name, JSON schema) of a JSON response format; None for text."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"type": "object"}
    spec = (response_format or {}).get("json_schema") or {}
    schema = spec.get("schema")
    return "response_format.json_schema.schema", schema if schema is not None else {}


def _chosen_tools(choice: Any, tools: Sequence[Mapping[str, Any]]) -> list[tuple[int, Any]]:
    """(index, function) of the tools a call may name."""
    functions = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"tools[{index}] must be {{\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}}")
        functions.append((index, function))
    if choice == "none":
        return []
    if isinstance(choice, Mapping):
        wanted = choice["function"]["name"]
        named = [(i, f) for i, f in functions if f["name"] == wanted]
        if not named:
            raise InvalidRequestError(f"tool_choice names {wanted!r}, which is not in tools")
        return named[:1]
    return functions


def _call_schema(function: Mapping[str, Any], key: str = "arguments") -> dict[str, Any]:
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             key: parameters},
            "required": ["name", key], "additionalProperties": False}


def _dumps(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return json.dumps(schema)  # not an object: llguidance's error names it
    return json.dumps({**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}})


def _marker(text: str, token_id: int | None) -> str:
    return json.dumps(text) if token_id is None else f"<[{token_id}]>"


def _text_without(*markers: str) -> str:
    """A lexeme of any non-empty text that holds none of ``markers`` (so where text and a
    marker both match, the marker is the longer match and wins)."""
    held = "|".join(_regex_quote(m) for m in markers)
    return f"/(.|\\n)+/ & ~/(.|\\n)*({held})(.|\\n)*/"


def _regex_quote(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}/-" else c for c in text)

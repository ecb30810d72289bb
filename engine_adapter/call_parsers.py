"""Tool-call parsers for the families mlx-lm has none for: Llama 3.x's JSON calls and
DeepSeek's ``<｜tool▁calls▁begin｜>`` blocks. Each has mlx-lm's parser shape (the text between
the family's markers, and the request's tools, in; a call ``{"name", "arguments"}`` or a list
of them out; ``ValueError`` when the text is not a call, which the splitter then passes on as
text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Llama 3.1/3.2/3.3 render a call as the whole reply: {"name": "f", "parameters": {...}} (no
# marker); the model may write several, separated by ";" (3.2), and "arguments" for
# "parameters" (what Hermes fine-tunes of it write).
LLAMA_START = '{"name":'
# DeepSeek V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>; V3 and the R1
# distills: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
DEEPSEEK_START, DEEPSEEK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_MARKERS = (DEEPSEEK_START, DEEPSEEK_END, "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                    "<｜tool▁call▁end｜>")
_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>",
                            re.S)
_FENCED = re.compile(r"\A([^\n]+)\n```(?:json)?\n(.*)\n```\s*\Z", re.S)


def _names(tools: Sequence[Mapping[str, Any]] | None) -> set[str]:
    return {str((t.get("function") or t).get("name")) for t in tools or ()
            if isinstance(t, Mapping)}


def parse_llama3_json(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> Any:
    """Calls of a Llama 3.x reply, ``text`` being what follows ``LLAMA_START``. Without a
    marker any JSON could look like a call: one counts only when it names a tool given."""
    decoder = json.JSONDecoder()
    source, pos, calls = LLAMA_START + text, 0, []
    names = _names(tools)
    while pos < len(source):
        value, pos = decoder.raw_decode(source, pos)   # JSONDecodeError is a ValueError
        if not isinstance(value, dict) or value.get("name") not in names:
            raise ValueError("not a call of a tool given")
        arguments = value.get("parameters", value.get("arguments", {}))
        if not isinstance(arguments, dict):
            raise ValueError("a call's parameters must be an object")
        calls.append({"name": value["name"], "arguments": arguments})
        rest = source[pos:].lstrip()
        if rest and not rest.startswith(";"):
            raise ValueError("text after a call")
        rest = rest[1:].lstrip() if rest else rest
        source, pos = rest, 0
    if not calls:
        raise ValueError("no call")
    return calls[0] if len(calls) == 1 else calls


def parse_deepseek(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> Any:
    """Calls of a DeepSeek tool-calls block (the text between its begin and end markers)."""
    calls = []
    for head, rest in _DEEPSEEK_CALL.findall(text):
        fenced = _FENCED.match(rest)
        name, arguments = (fenced[1], fenced[2]) if fenced else (head, rest)
        value = json.loads(arguments)
        if not isinstance(value, dict):
            raise ValueError("a call's arguments must be an object")
        calls.append({"name": name.strip(), "arguments": value})
    if not calls:
        raise ValueError("no call in the block")
    return calls[0] if len(calls) == 1 else calls

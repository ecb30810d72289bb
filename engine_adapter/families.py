"""The model families' tool-call formats, and the registry of families the tests check.

A tokenizer's call format is mlx-lm's where mlx-lm knows its family (``tool_parser_type`` in
the tokenizer config, or read off the chat template: ``json_tools``, ``qwen3_coder``,
``mistral``, ``glm47``, ``kimi_k2``, ``gemma4``, ...), else one of this project's
(``call_parsers``: Llama 3.x's JSON calls, DeepSeek's blocks) when the template writes calls
that way, else none (the engine's own envelope, see ``tool_calls.json_envelope``).

How a forced call (``tool_choice`` required or named) is written, by format: ``json_tools``
and Llama 3.x's under a grammar in the family's own format; DeepSeek's in the engine's
envelope (``<tool_call>`` JSON ``</tool_call>``; not yet the family's syntax); the other mlx-lm
formats not at all (a 400). ``FAMILIES`` is what ``tests/agent_apis/test_family_calls.py`` checks, one
row per family, and what ``python -m engine_adapter.families`` prints as docs/engine.md's
table (a test keeps the two equal).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefix_cache.render.render import unwrap_tokenizer

from .call_parsers import (
    DEEPSEEK_END,
    DEEPSEEK_MARKERS,
    DEEPSEEK_START,
    LLAMA_START,
    parse_deepseek,
    parse_llama3_json,
)

Parser = Callable[[str, Any], Any]
NATIVE, ENGINE_ENVELOPE, NOT_CONSTRAINED = "family's own format", "engine's envelope", "no (400)"
GRAMMAR_FORMATS = ("json_tools", "llama3_json")   # formats a grammar writes natively


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a family writes tool calls: between ``start`` and ``end`` ("" = to the end of the
    reply), read by ``parse``; ``markers``: every marker the parser reads (kept in the decoded
    text where the tokenizer marks them special)."""

    name: str
    start: str
    end: str
    parse: Parser
    markers: tuple[str, ...]

    @property
    def forced(self) -> str:
        """How a forced call is written (``NATIVE``, ``ENGINE_ENVELOPE``, ``NOT_CONSTRAINED``)."""
        return forced_calls(self.name)


# This project's formats: (name, what the template shows, start, end, parser, markers).
OWN_FORMATS: tuple[tuple[str, tuple[str, ...], str, str, Parser, tuple[str, ...]], ...] = (
    ("deepseek", (DEEPSEEK_START,), DEEPSEEK_START, DEEPSEEK_END, parse_deepseek,
     DEEPSEEK_MARKERS),
    ("llama3_json", ('{"name": "', '"parameters": '), LLAMA_START, "", parse_llama3_json,
     ("<|python_tag|>",)),
)


def forced_calls(name: str | None) -> str:
    """How a forced call is written for call format ``name`` (None: the template names none)."""
    if name in GRAMMAR_FORMATS:
        return NATIVE
    if name is None or name in {f[0] for f in OWN_FORMATS}:
        return ENGINE_ENVELOPE
    return NOT_CONSTRAINED


def call_format(tokenizer: Any) -> CallFormat | None:
    """The tokenizer's tool-call format: mlx-lm's, else this project's by the template, else
    None."""
    start = getattr(tokenizer, "tool_call_start", None)
    parse = getattr(tokenizer, "tool_parser", None)
    end = getattr(tokenizer, "tool_call_end", None)
    if start and parse is not None and end is not None:
        name = getattr(parse, "__module__", "").rsplit(".", 1)[-1]
        return CallFormat(name, start, end, parse, tuple(m for m in (start, end) if m))
    template = getattr(unwrap_tokenizer(tokenizer), "chat_template", None)
    if not isinstance(template, str):
        return None
    for name, shows, start, end, parser, markers in OWN_FORMATS:
        if all(s in template for s in shows):
            return CallFormat(name, start, end, parser, markers)
    return None


@dataclass(frozen=True, slots=True)
class Family:
    """A family the tests round-trip: its template (``shared/chat_templates``), the offline
    tokenizer it is rendered with, its call format, whether the template renders several
    calls in one turn, the text its generated turn ends at ("": the rendered turn's end), and
    its reasoning markers."""

    name: str
    template: str
    tokenizer: str
    calls: str | None
    parallel: bool
    end_of_turn: str
    reasoning: str | None = None


FAMILIES: tuple[Family, ...] = (
    Family("Qwen3", "Qwen-Qwen3-0.6B", "qwen3", "json_tools", True, "<|im_end|>", "<think>"),
    Family("Qwen2.5", "Qwen-Qwen2.5-7B-Instruct", "qwen2.5", "json_tools", True, "<|im_end|>"),
    Family("Hermes 3", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "llama3.1", "json_tools",
           True, "<|im_end|>"),
    Family("Qwen3-Coder", "Qwen3-Coder", "qwen3", "qwen3_coder", True, "<|im_end|>"),
    Family("Qwen3.5", "Qwen3.5-4B", "qwen3.5", "qwen3_coder", True, "<|im_end|>", "<think>"),
    Family("Llama 3.1", "meta-llama-Llama-3.1-8B-Instruct", "llama3.1", "llama3_json", False,
           "<|eot_id|>"),
    Family("Llama 3.3", "meta-llama-Llama-3.3-70B-Instruct", "llama3.1", "llama3_json", False,
           "<|eot_id|>"),
    Family("Mistral Nemo", "mistralai-Mistral-Nemo-Instruct-2407", "tekken-240718", "mistral",
           True, "</s>"),
    Family("Devstral (Mistral v13)", "unsloth-mistral-Devstral-Small-2507", "tekken-240911",
           "mistral", True, "</s>"),
    Family("DeepSeek V3.1", "deepseek-ai-DeepSeek-V3.1", "deepseek", "deepseek", True,
           "<｜end▁of▁sentence｜>", "<think>"),
    Family("GLM-4.6", "GLM-4.6", "qwen3", "glm47", True, "", "<think>"),
    Family("Kimi K2", "moonshotai-Kimi-K2", "qwen3", "kimi_k2", True, "<|im_end|>"),
    Family("Gemma 4", "google-gemma-4-31B-it", "qwen3", "gemma4", True, "<|tool_response>"),
    Family("gpt-oss (harmony)", "openai-gpt-oss-120b", "gpt-oss", None, False, "<|call|>"),
)


def family_table() -> str:
    """docs/engine.md's family table, from ``FAMILIES``."""
    rows = ["| family | template | call format | parsed | forced calls written in | "
            "parallel | reasoning |", "|---|---|---|---|---|---|---|"]
    for f in FAMILIES:
        rows.append(f"| {f.name} | `{f.template}` | {f.calls or 'none known'} | "
                    f"{'yes' if f.calls else 'no'} | {forced_calls(f.calls)} | "
                    f"{'yes' if f.parallel else 'one call a turn'} | "
                    f"{f'`{f.reasoning}`' if f.reasoning else '-'} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(family_table())

"""The tool-call parsers this project adds (Llama 3.x JSON, DeepSeek) on the forms their
families write, and what is not a call passed on as text."""

from __future__ import annotations

import pytest

from engine_adapter.call_parsers import LLAMA_START, parse_deepseek, parse_llama3_json
from engine_adapter.families import CallFormat
from engine_adapter.tool_calls import ToolCallSplitter

TOOLS = [{"type": "function", "function": {"name": "f"}},
         {"type": "function", "function": {"name": "g"}}]


def test_llama_calls_one_or_several():
    one = '{"name": "f", "parameters": {"a": 1}}'
    assert parse_llama3_json(one[len(LLAMA_START):], TOOLS) == {"name": "f",
                                                                 "arguments": {"a": 1}}
    several = '{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": 2}}'
    assert parse_llama3_json(several[len(LLAMA_START):], TOOLS) == [
        {"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": 2}}]


@pytest.mark.parametrize("text", [
    '{"name": "Bob", "parameters": {}}',            # not a tool given
    '{"name": "f", "parameters": {}} and more',     # text after it
    '{"name": "f", "parameters": [1]}',
    '{"name": "f", "parameters": {',                # cut off
])
def test_what_is_not_a_llama_call_stays_text(text):
    splitter = ToolCallSplitter(LLAMA_START, "", parse_llama3_json, TOOLS)
    assert "".join(map(str, splitter.feed("Here: " + text, final=True))) == "Here: " + text


def test_deepseek_v3_1_and_r1_calls():
    v31 = ("<｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜>"
           "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜>")
    assert parse_deepseek(v31) == [{"name": "f", "arguments": {"a": 1}},
                                   {"name": "g", "arguments": {}}]
    r1 = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```"
          "<｜tool▁call▁end｜>")
    assert parse_deepseek(r1) == {"name": "f", "arguments": {"a": 1}}
    with pytest.raises(ValueError):
        parse_deepseek("no call here")


def test_a_format_names_its_forced_calls():
    fmt = CallFormat("deepseek", "<a>", "</a>", parse_deepseek, ("<a>", "</a>"))
    assert fmt.forced == "engine's envelope"
    assert CallFormat("qwen3_coder", "<a>", "</a>", parse_deepseek, ()).forced == "no (400)"


def test_the_family_table_in_the_docs_is_the_generators():
    from pathlib import Path

    from engine_adapter.families import family_table

    text = (Path(__file__).parents[2] / "docs" / "engine.md").read_text("utf-8")
    copy = text.split("<!-- families:start -->\n", 1)[1].split("<!-- families:end -->", 1)[0]
    assert copy == family_table(), "run: python -m engine_adapter.families"

"""Tool calls written under a grammar, streamed as written: however the text is cut into
deltas, the pieces add up to the text around the calls and each call's exact arguments."""

from __future__ import annotations

import json

import pytest

from engine_adapter.call_stream import StreamedCalls
from engine_adapter.grammar.build import ENGINE_ENVELOPE, Envelope
from prefix_cache.engine.protocol import ToolCallChunk

CALLS = [("add_numbers", {"a": 2, "b": {"c": [1, "}"]}}), ("get_weather", {"city": "Zürich"})]


def written(envelope: Envelope, newline: str) -> str:
    return "".join(
        envelope.start + newline + json.dumps({"name": name, "arguments": args},
                                              ensure_ascii=False) + newline + envelope.end
        for name, args in CALLS)


def assemble(pieces: list[str | ToolCallChunk]) -> tuple[str, list[tuple[str, str]]]:
    text, calls = "", {}
    for piece in pieces:
        if isinstance(piece, str):
            text += piece
            continue
        name, args = calls.get(piece.index, ("", ""))
        calls[piece.index] = (name + (piece.name or ""), args + piece.arguments)
        assert (piece.id is not None) == (piece.name is not None)  # id and name come first
    return text, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("envelope", [ENGINE_ENVELOPE, Envelope("[C]", "[/C]")])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("newline", ["", "\n"])  # Qwen/Hermes write one inside the markers
def test_the_pieces_add_up_to_the_calls_whatever_the_cut(envelope: Envelope, size: int,
                                                         newline: str) -> None:
    source = written(envelope, newline)
    stream = StreamedCalls(envelope)
    pieces = []
    for i in range(0, len(source), size):
        pieces += stream.feed(source[i:i + size])
    pieces += stream.feed("", final=True)
    text, calls = assemble(pieces)
    assert text == ""
    assert [(n, json.loads(a)) for n, a in calls] == CALLS
    assert stream.calls == 2
    # Arguments stream: with small deltas, a call arrives in several pieces.
    if size < 3:
        assert sum(isinstance(p, ToolCallChunk) and p.index == 0 for p in pieces) > 3


def test_text_passes_and_a_cut_off_call_ends_with_what_was_written() -> None:
    stream = StreamedCalls(ENGINE_ENVELOPE)
    pieces = stream.feed("Sure. <tool_") + stream.feed('call>{"name": "f", "arguments": {"x": 1')
    pieces += stream.feed("", final=True)
    text, calls = assemble(pieces)
    assert text == "Sure. " and calls == [("f", '{"x": 1')]


def test_a_call_not_in_the_grammars_shape_passes_as_text() -> None:
    stream = StreamedCalls(ENGINE_ENVELOPE)
    pieces = stream.feed("<tool_call>oops</tool_call> after", final=True)
    assert assemble(pieces) == ("<tool_call>oops</tool_call> after", [])

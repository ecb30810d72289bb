"""The agent APIs' conversion to the chat-template conversation (the documented mapping, case by
case), what is refused, the detection of a body's API, the SSE decoder, the response store,
and the CLI reading all three body shapes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from prefix_cache import cli
from prefix_cache.chat.agent_call import AgentCall
from prefix_cache.chat.anthropic_params import messages_conversation, parse_messages_body
from prefix_cache.chat.bodies import conversation_of, detect_api
from prefix_cache.chat.conversation import chat_wire_messages
from prefix_cache.chat.responses_params import parse_responses_body
from prefix_cache.chat.responses_store import MemoryResponses, StoredResponse
from prefix_cache.errors import InvalidRequestError
from prefix_cache.http.errors import BadRequest
from prefix_cache.http.sse import EventStreamError, SSEDecoder
from prefix_cache.testing.offline_tokenizers import make_model_dir
from tests.support.templates import BEHAVIOURS

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOL_CHAT = {"type": "function", "function": {"name": "read", "description": "Read a file.",
                                              "parameters": SCHEMA}}
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def anthropic_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, **fields}


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return parse_messages_body(anthropic_body(**body)).conversation.messages


def responses(body: dict[str, Any], history: list[Any] | None = None) -> AgentCall:
    return parse_responses_body(body, lambda _: history).call


# -- Anthropic Messages ---------------------------------------------------------------------


def test_an_anthropic_agent_turn_maps_to_the_template_conversation() -> None:
    body = anthropic_body(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                {"type": "text", "text": "You are a coder.", "cache_control": {"type": "x"}},
                {"type": "text", "text": "\nBe brief."}],
        tools=[{"name": "read", "description": "Read a file.", "input_schema": SCHEMA,
                "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Look at"},
                                         {"type": "image", "source": PNG},
                                         {"type": "text", "text": "and read a.txt"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": "s"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a"}},
                {"type": "tool_use", "id": "toolu_2", "name": "read", "input": {"path": "b"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "A"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "B1"}, {"type": "text", "text": "B2"}]},
                {"type": "text", "text": "Now fix it."}]},
        ])
    call = parse_messages_body(body)
    assert call.conversation.tools == [TOOL_CHAT]
    assert call.conversation.messages == [
        {"role": "system", "content": "You are a coder.\nBe brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Look at"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "text", "text": "and read a.txt"}]},
        {"role": "assistant", "content": "Reading.", "reasoning_content": "I should read it.",
         "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "read",
                                                               "arguments": {"path": "a"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "read",
                                                               "arguments": {"path": "b"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "A"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "B1\nB2"},
        {"role": "user", "content": "Now fix it."},
    ]
    assert call.sampling.max_tokens == 16 and call.sampling.temperature == 1.0
    assert not call.stream and call.engine_refusal is None


@pytest.mark.parametrize("system, expected", [
    ("Plain.", [{"role": "system", "content": "Plain."}]),
    ("", []),
    ([], []),
    ([{"type": "text", "text": "x-anthropic-billing-header: a"}], []),
    ([{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
     [{"role": "system", "content": "AB"}]),
])
def test_the_system_prompt(system: Any, expected: list[dict[str, Any]]) -> None:
    assert messages({"system": system, "messages": [{"role": "user", "content": "x"}]}) \
        == [*expected, {"role": "user", "content": "x"}]


def test_tool_results_come_before_the_turn_text_and_their_images_after_them() -> None:
    out = messages({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "First"},
        {"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "seen"},
            {"type": "image", "source": {"type": "url", "url": "https://x/i.png"}}]},
        {"type": "tool_result", "tool_use_id": "t2"},
        {"type": "text", "text": ""},
    ]}]})
    assert out == [
        {"role": "user", "content": "First"},
        {"role": "tool", "tool_call_id": "t1", "content": "seen"},
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": "https://x/i.png"}}]},
        {"role": "tool", "tool_call_id": "t2", "content": ""},
    ]


def test_an_assistant_turn_of_tool_calls_only_has_empty_text() -> None:
    out = messages({"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": "ok"}]}]})
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": {}}}]}


def test_generation_fields_and_chat_options() -> None:
    call = parse_messages_body(anthropic_body(
        messages=[{"role": "user", "content": "x"}], temperature=0.3, top_p=0.9, top_k=4,
        stop_sequences=["END", ""], stream=True, specprefill_keep_pct=0.5,
        tool_choice={"type": "tool", "name": "read", "disable_parallel_tool_use": True}))
    assert call.sampling.stop == ("END",) and call.sampling.temperature == 0.3
    assert call.stream and call.specprefill.keep_pct == 0.5
    assert call.chat_options == {"tool_choice": {"type": "function",
                                                 "function": {"name": "read"}},
                                 "parallel_tool_calls": False, "top_k": 4,
                                 "temperature": 0.3, "top_p": 0.9}
    assert call.engine_refusal is not None and "top_k" in call.engine_refusal
    body = call.chat_body("served")
    assert body["stream_options"] == {"include_usage": True} and body["top_k"] == 4
    assert body["specprefill_keep_pct"] == 0.5 and body["stop"] == ["END"]


def test_structured_output_goes_to_upstreams_and_to_the_engine() -> None:
    call = parse_messages_body(anthropic_body(
        messages=[{"role": "user", "content": "x"}],
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": SCHEMA}}))
    assert call.chat_options == {"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": SCHEMA}}}
    call.check_engine_support()  # the engine honours it under a grammar
    assert call.constraints().binding
    effort_only = parse_messages_body(anthropic_body(
        messages=[{"role": "user", "content": "x"}], output_config={"effort": "low"}))
    assert effort_only.engine_refusal is None and effort_only.chat_options == {}


@pytest.mark.parametrize("fields, fragment", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role: 'tool'"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {
        "type": "json_object"}}}, "output_config.format must be"),
    ({"messages": [{"role": "user", "content": []}]}, "non-empty list"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document' block"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "with a 'type'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "f"}}]}]}, "source must be"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "source": PNG}]},
                   {"role": "user", "content": "x"}]}, "'image' block is not supported"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                      "name": "f", "input": "{}"}]},
                   {"role": "user", "content": "x"}]}, "object input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Su"}]},
     "prefill"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tool type 'bash_20250124'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
     "input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]},
     "system[0] must be a text block"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}},
     "tool_choice"),
])
def test_what_anthropic_bodies_are_refused(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_messages_body(anthropic_body(**fields))
    assert fragment in str(info.value)


@pytest.mark.parametrize("body", [
    {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},      # no model
    {"model": "m", "messages": [{"role": "user", "content": "x"}]},         # no max_tokens
    anthropic_body(messages=[{"role": "user", "content": "x"}], temperature=1.5),
    anthropic_body(messages=[{"role": "user", "content": "x"}], stream="yes"),
    anthropic_body(messages=[]),
])
def test_anthropic_field_types_are_checked(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        parse_messages_body(body)


# -- OpenAI Responses -----------------------------------------------------------------------


def test_responses_items_map_to_the_template_conversation() -> None:
    call = responses({
        "model": "m", "instructions": "You are a coder.",
        "tools": [{"type": "function", "name": "read", "description": "Read a file.",
                   "parameters": SCHEMA, "strict": True}],
        "input": [
            {"role": "developer", "content": "Prefer small diffs."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Look at"},
                {"type": "input_image", "image_url": "https://x/i.png", "detail": "low"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Reading.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "read",
             "arguments": '{"path": "a"}'},
            {"type": "function_call", "call_id": "c2", "name": "read", "arguments": "oops"},
            {"type": "function_call_output", "call_id": "c1", "output": "A"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "B"}]},
        ]})
    assert call.conversation.tools == [TOOL_CHAT]
    assert call.conversation.messages == [
        {"role": "system", "content": "You are a coder."},
        {"role": "developer", "content": "Prefer small diffs."},
        {"role": "user", "content": [
            {"type": "text", "text": "Look at"},
            {"type": "image_url", "image_url": {"url": "https://x/i.png"}}]},
        {"role": "assistant", "content": "Reading.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read",
                                                          "arguments": {"path": "a"}}},
            {"id": "c2", "type": "function", "function": {"name": "read",
                                                          "arguments": "oops"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "A"},
        {"role": "tool", "tool_call_id": "c2", "content": "B"},
    ]


def test_previous_response_id_puts_its_items_first_without_its_instructions() -> None:
    history = [{"role": "user", "content": "Hi"},
               {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                "content": [{"type": "output_text", "text": "Hello", "annotations": []}]}]
    parsed = parse_responses_body({"input": "Again", "instructions": "New rules.",
                                   "previous_response_id": "resp_1"}, lambda _: history)
    assert parsed.call.conversation.messages == [
        {"role": "system", "content": "New rules."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    kept = parsed.conversation_items({"output": [{"type": "message", "role": "assistant",
                                                  "content": "Bye"}]})
    assert kept == [*history, {"role": "user", "content": "Again"},
                    {"type": "message", "role": "assistant", "content": "Bye"}]
    with pytest.raises(BadRequest) as info:
        parse_responses_body({"input": "x", "previous_response_id": "resp_2"}, lambda _: None)
    assert info.value.code == "previous_response_not_found"
    assert info.value.param == "previous_response_id" and info.value.status == 400


def test_responses_generation_fields() -> None:
    call = responses({"input": "x", "max_output_tokens": 9, "temperature": 1.5, "top_p": 0.5,
                      "tool_choice": {"type": "function", "name": "read"},
                      "parallel_tool_calls": False, "text": {"format": {"type": "text"}}})
    assert (call.sampling.max_tokens, call.sampling.temperature, call.sampling.top_p) \
        == (9, 1.5, 0.5)
    assert call.chat_options == {"tool_choice": {"type": "function",
                                                 "function": {"name": "read"}},
                                 "parallel_tool_calls": False, "temperature": 1.5,
                                 "top_p": 0.5}
    assert call.engine_refusal is None
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    structured = responses({"input": "x", "reasoning": {"effort": "high", "summary": "auto"},
                            "text": {"format": {"type": "json_schema", "name": "out",
                                                "schema": schema, "strict": True}}})
    assert structured.chat_options == {"reasoning_effort": "high", "response_format": {
        "type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                               "strict": True}}}
    assert "text.format" not in (structured.engine_refusal or "")
    assert structured.constraints().binding
    effort = responses({"input": "x", "reasoning": {"effort": "low"}})
    assert effort.engine_refusal is None  # accepted, no effect: agents send it every turn
    with pytest.raises(InvalidRequestError, match="text.format must be"):
        responses({"input": "x", "text": {"format": {"type": "json_schema"}}})


@pytest.mark.parametrize("body, fragment", [
    ({"input": [{"role": "tool", "content": "x"}]}, "'tool' is not one of"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference'"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "'web_search_call'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": {"a": 1}}]}, "string call_id, name and arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input_image (with an image_url)"),
    ({"input": [{"role": "user", "content": 5}]}, "a string or a list"),
    ({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}, "'custom'"),
    ({"input": "x", "tools": [{"type": "function"}]}, "name must be"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "conversation": "conv_1"}, "conversation is not supported"),
    ({"input": []}, "must not be empty"),
])
def test_what_responses_bodies_are_refused(body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        responses(body)
    assert fragment in str(info.value)


def test_chat_wire_messages_send_arguments_as_json_text() -> None:
    conversation = responses({"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"n": 1}'},
        {"type": "function_call_output", "call_id": "c", "output": "ok"}]}).conversation
    wire = chat_wire_messages(conversation.messages)
    assert wire[0]["tool_calls"][0]["function"]["arguments"] == '{"n":1}'
    assert conversation.messages[0]["tool_calls"][0]["function"]["arguments"] == {"n": 1}


# -- which API a body is in -----------------------------------------------------------------


@pytest.mark.parametrize("body, api", [
    ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]},
     "chat"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "y"}]}]}, "chat"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "chat"),
    ({"system": "x", "messages": [{"role": "user", "content": "y"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "y"}], "tools": [{"name": "f",
                                                                "input_schema": {}}]},
     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": PNG}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                 "tool_use_id": "t"}]}]}, "messages"),
    ({"input": "y"}, "responses"),
    ({"input": [{"role": "user", "content": "y"}], "instructions": "x"}, "responses"),
])
def test_the_api_of_a_body_is_detected(body: dict[str, Any], api: str) -> None:
    assert detect_api(body) == api


def test_a_conversation_needs_no_generation_fields_and_no_stored_response() -> None:
    body = {"system": "S", "messages": [{"role": "user", "content": "x"}]}
    assert messages_conversation(body).messages == conversation_of(body).messages
    with pytest.raises(InvalidRequestError, match="whole conversation"):
        conversation_of({"input": "x", "previous_response_id": "resp_1"})


# -- SSE decoding, the response store -------------------------------------------------------


def test_the_sse_decoder_follows_the_event_stream_rules() -> None:
    decoder = SSEDecoder(max_bytes=64)
    stream = b": comment\r\nevent: a\r\ndata: 1\r\ndata:2\r\n\r\ndata: {\"x\"\ndata: 3\n\n"
    events = [e for i in range(len(stream)) for e in decoder.feed(stream[i:i + 1])]
    assert [(e.event, e.data) for e in events] == [("a", "1\n2"), (None, '{"x"\n3')]
    with pytest.raises(EventStreamError):
        SSEDecoder(max_bytes=8).feed(b"data: " + b"x" * 20)


def record(response_id: str, items: list[Any]) -> StoredResponse:
    return StoredResponse({"id": response_id, "output": []}, items, 0, len(items))


def test_the_response_store_keeps_tenants_apart_and_bounded() -> None:
    store = MemoryResponses(max_bytes_per_tenant=2048)
    items = [{"role": "user", "content": "x" * 300}]

    async def run() -> None:
        assert await store.put("acme", record("resp_1", items))
        got = await store.get("acme", "resp_1")
        assert got is not None and got.items == items and got.input_items == items
        assert await store.get("globex", "resp_1") is None
        for i in range(2, 12):  # acme's own puts evict acme's oldest; globex's are untouched
            await store.put("globex", record(f"resp_g{i}", []))
            await store.put("acme", record(f"resp_{i}", items))
        assert await store.get("acme", "resp_1") is None
        assert (await store.get("globex", "resp_g2")) is not None
        assert not await store.put("acme", record("huge", [{"content": "x" * 4096}]))
        kept = await store.get("acme", "resp_11")
        assert kept is not None
        kept.items.append("changed")  # what a caller does with its copy changes nothing stored
        assert (await store.get("acme", "resp_11")).items == items  # type: ignore[union-attr]
        assert not await store.delete("globex", "resp_11")  # another tenant's: not there
        assert await store.delete("acme", "resp_11") and await store.get("acme", "resp_11") is None
        assert not await store.delete("acme", "resp_11")

    asyncio.run(run())


# -- the CLI reads all three shapes ---------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("agent") / "demo-qwen3", "qwen3",
                          BEHAVIOURS["default_system"])


def test_the_cli_detects_each_line_and_gives_the_chat_boundary(
        model_dir: Path, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    system, tools = "You are the CLI agent.", [TOOL_CHAT]
    chat = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Read a."}], "tools": tools}
    anthropic = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": system}],
                 "messages": [{"role": "user", "content": "Read a."}],
                 "tools": [{"name": "read", "description": "Read a file.",
                            "input_schema": SCHEMA}]}
    openai_responses = {"model": "m", "instructions": system, "input": "Read a.",
                        "tools": [{"type": "function", "name": "read",
                                   "description": "Read a file.", "parameters": SCHEMA}]}
    rows = [chat, anthropic, openai_responses, {"input": "x", "previous_response_id": "r"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code = cli.main(["boundary", "--model", str(model_dir), "--requests", str(path)])
    lines = [json.loads(line) for line in capsysbinary.readouterr().out.decode().splitlines()]
    assert code == 2 and len(lines) == 4
    assert [line.get("cache") for line in lines] == ["miss", "hit", "hit", None]
    assert lines[0]["specprefill_system_end"] > 0
    assert all(line["specprefill_system_end"] == lines[0]["specprefill_system_end"]
               and line["prompt_tokens"] == lines[0]["prompt_tokens"] for line in lines[1:3])
    assert "whole conversation" in lines[3]["error"]
    # Named: text blocks read as Anthropic's (joined) -- the same prompt as the plain string.
    blocks = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Read a."}]}],
              "system": system, "tools": anthropic["tools"]}
    path.write_text(json.dumps(blocks) + "\n")
    assert cli.main(["boundary", "--model", str(model_dir), "--requests", str(path),
                     "--api", "messages"]) == 0
    line = json.loads(capsysbinary.readouterr().out)
    assert line["prompt_tokens"] == lines[0]["prompt_tokens"]


# -- tool calls cut out of text, delta by delta ---------------------------------------------


@pytest.mark.parametrize("end", ["</tool_call>", ""])
def test_tool_call_markers_split_across_deltas_are_found(end: str) -> None:
    from engine_adapter.families import call_format
    from engine_adapter.tool_calls import ToolCallSplitter

    def parse(text: str, _: Any) -> Any:
        return json.loads(text.strip())  # mlx-lm's json_tools parser

    call = '{"name": "f", "arguments": {"x": 1}}'
    text = f"a <tool_c and <tool_call>{call}{end}"
    if end:
        text += f" then<tool_call>{call}{end}!"
    splitter = ToolCallSplitter("<tool_call>", end, parse, [TOOL_CHAT])
    pieces = [p for i, ch in enumerate(text)
              for p in splitter.feed(ch, final=i == len(text) - 1)]
    texts = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if not isinstance(p, str)]
    assert texts == ("a <tool_c and  then!" if end else "a <tool_c and ")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})] * (
        2 if end else 1)
    assert len({c.id for c in calls}) == len(calls) and splitter.calls == len(calls)
    assert ToolCallSplitter.for_format(call_format(object()), [TOOL_CHAT]) is None  # no parser known


@pytest.mark.parametrize("body, fragment", [
    ({"response_format": {"type": "xml"}}, "response_format.type must be one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": 1}}},
     "response_format.json_schema.strict must be"),
    ({"tool_choice": "always"}, "tool_choice must be"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice must be"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls must be a boolean"),
])
def test_chat_fields_that_bind_the_output_are_checked_in_shape(body: dict[str, Any],
                                                               fragment: str) -> None:
    from prefix_cache.chat.openai_params import parse_chat_body

    chat = {"messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(InvalidRequestError, match=fragment):
        parse_chat_body(chat, run_here=True)
    assert parse_chat_body(chat, run_here=False).call.chat_options == {}  # the upstream's to check


def test_chat_fields_that_bind_the_output_reach_the_engine() -> None:
    from prefix_cache.chat.openai_params import parse_chat_body

    call = parse_chat_body({"messages": [{"role": "user", "content": "x"}],
                            "response_format": {"type": "json_object"},
                            "tool_choice": {"type": "function", "function": {"name": "f"}},
                            "parallel_tool_calls": False}, run_here=True).call
    constraints = call.backend_request([1, 2], 1, "default").constraints
    assert constraints.binding and not constraints.parallel_tool_calls
    assert constraints.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert constraints.response_format == {"type": "json_object"}

"""The agent APIs through the sidecar to a recording upstream, with the real ``anthropic`` and
``openai`` SDKs as clients: what is forwarded (the body unchanged to an upstream that serves
the API, plus the boundary fields for ``specprefill`` ones; a chat completion to one that does
not), what comes back (relayed, or converted back to the API's shape), the boundary (the one
``/v1/prefix/boundary`` gives for the same conversation written as a chat body by hand), and
``previous_response_id`` kept per tenant."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from prefix_cache.service import ServiceSettings
from prefix_cache.service.upstream import Upstream

from tests.support.agent_upstream import READ, READ_CHAT, READ_RESPONSES, AgentRecorder
from tests.support.loopback import anthropic_client, local_client, openai_client
from tests.support.redis_server import needs_redis
from tests.support.server_thread import ServerThread
from tests.support.sidecar import TENANT_KEYS, bearer, served, sidecar_app, unique_system

PURGE_ADMIN_KEY = "sk-admin"

anthropic = pytest.importorskip("anthropic", reason="the Anthropic SDK is the client under test")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")


@pytest.fixture(scope="module")
def app(agent_app: Any) -> Any:
    return agent_app  # the sidecar the module's ``base`` serves (tests/support/service_fixtures)


def chat_boundary(base: str, body: dict[str, Any], key: str = "sk-acme") -> dict[str, Any]:
    with local_client(base_url=base, headers=bearer(key)) as http:
        r = http.post("/v1/prefix/boundary", json={**body, "return_prompt_ids": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


def agent_turns(system_text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """An Anthropic agent's second turn (a tool round trip) and the same conversation as a
    chat body's messages, written by hand from the documented mapping."""
    anthropic_messages = [
        {"role": "user", "content": [{"type": "text", "text": "Read a.txt,"},
                                     {"type": "text", "text": "then summarize it."}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file",
             "input": {"path": "a.txt"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello world"},
            {"type": "text", "text": "Go on."}]},
    ]
    chat_messages = [
        {"role": "system", "content": system_text},
        {"role": "user", "content": "Read a.txt,\nthen summarize it."},
        {"role": "assistant", "content": "Reading it.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "read_file", "arguments": {"path": "a.txt"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "hello world"},
        {"role": "user", "content": "Go on."},
    ]
    return anthropic_messages, chat_messages


# -- Anthropic Messages ---------------------------------------------------------------------


def test_messages_go_unchanged_to_an_upstream_that_serves_them(base: str,
                                                               rec: AgentRecorder) -> None:
    sdk = anthropic_client(base)
    system = unique_system()["content"]
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
              {"type": "text", "text": system[:10], "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": system[10:]}]
    raw = json.dumps({"model": "native", "max_tokens": 8, "system": blocks, "tools": [READ],
                      "messages": [{"role": "user", "content": "Read a.txt."}],
                      "metadata": {"user_id": "u1"}}, indent=1).encode()
    with local_client(base_url=base, headers={"x-api-key": "sk-acme"}) as http:
        first = http.post("/v1/messages", content=raw,
                          headers={"content-type": "application/json"})
    assert first.status_code == 200 and first.headers["x-prefix-cache"] == "miss"
    assert rec.last("messages").raw == raw  # byte for byte
    assert first.json()["content"] == [{"type": "text", "text": "recorded"}]
    turns, chat_messages = agent_turns(system)
    second = sdk.messages.with_raw_response.create(
        model="native", max_tokens=8, tools=[READ], messages=turns,
        system=[{**blocks[0], "text": blocks[0]["text"].replace("abc", "xyz")}, *blocks[1:]])
    assert second.headers["x-prefix-cache"] == "hit"  # the billing header is not rendered
    expected = chat_boundary(base, {"model": "native", "messages": chat_messages,
                                    "tools": [READ_CHAT]})
    assert second.headers["x-specprefill-system-end"] == str(expected["specprefill_system_end"])
    assert expected["specprefill_system_end"] > 0 and expected["cache"] == "hit"


def test_a_specprefill_upstream_gets_the_boundary_and_the_prompt_ids(base: str,
                                                                    rec: AgentRecorder) -> None:
    system = unique_system()["content"]
    turns, chat_messages = agent_turns(system)
    with anthropic_client(base).messages.stream(model="native-spec", max_tokens=8, system=system,
                                      tools=[READ], messages=turns) as stream:
        assert "".join(stream.text_stream) == "recorded"
    sent = rec.last("messages").body
    expected = chat_boundary(base, {"model": "native-spec", "messages": chat_messages,
                                    "tools": [READ_CHAT]})
    assert sent["specprefill_system_end"] == expected["specprefill_system_end"] > 0
    assert sent["prompt_token_ids"] == expected["prompt_ids"]
    assert sent["specprefill_namespace"] == "acme" and sent["messages"] == turns


def test_messages_become_a_chat_completion_for_a_chat_only_upstream(base: str,
                                                                    rec: AgentRecorder) -> None:
    system = unique_system()["content"]
    turns, chat_messages = agent_turns(system)
    rec.tool_call = ("call_9", "read_file", {"path": "b.txt", "n": 2**70})
    raw = anthropic_client(base).messages.with_raw_response.create(
        model="chat-only", max_tokens=8, system=system, tools=[READ], messages=turns,
        extra_body={"temperature": 0.5}, stop_sequences=["END"], tool_choice={"type": "any"})
    message = raw.parse()
    sent = rec.last("chat").body
    wire = [dict(m) for m in chat_messages]
    wire[2] = {**wire[2], "tool_calls": [{**wire[2]["tool_calls"][0], "function": {
        "name": "read_file", "arguments": json.dumps({"path": "a.txt"}, separators=(",", ":"))}}]}
    assert sent == {"model": "chat-only", "messages": wire, "tools": [READ_CHAT],
                    "max_tokens": 8, "temperature": 0.5, "stop": ["END"],
                    "tool_choice": "required"}  # no top_p: the client sent none
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "recorded"
    call = message.content[1]
    assert (call.id, call.name, call.input) == ("call_9", "read_file",
                                               {"path": "b.txt", "n": 2**70})
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens,
            message.usage.output_tokens) == (7, 4, 3)
    expected = chat_boundary(base, {"model": "chat-only", "messages": chat_messages,
                                    "tools": [READ_CHAT]})
    assert raw.headers["x-specprefill-system-end"] == str(expected["specprefill_system_end"])


def test_a_streamed_chat_completion_comes_back_as_anthropic_events(base: str,
                                                                   rec: AgentRecorder) -> None:
    rec.tool_call = ("call_7", "read_file", {"path": "c.txt"})
    with anthropic_client(base).messages.stream(
            model="chat-only-spec", max_tokens=8, system=unique_system()["content"],
            tools=[READ], messages=[{"role": "user", "content": "Read c.txt."}]) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "recorded" and message.content[1].input == {"path": "c.txt"}
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 3
    sent = rec.last("chat").body
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["specprefill_system_end"] > 0 and sent["specprefill_namespace"] == "acme"


def test_count_tokens_counts_the_prompt_the_conversation_renders_to(base: str) -> None:
    system = unique_system()["content"]
    turns, chat_messages = agent_turns(system)
    count = anthropic_client(base).messages.count_tokens(model="chat-only", system=system, tools=[READ],
                                               messages=turns)
    expected = chat_boundary(base, {"model": "chat-only", "messages": chat_messages,
                                    "tools": [READ_CHAT]})
    assert count.input_tokens == expected["prompt_tokens"] and expected["cache"] == "hit"


def test_bad_messages_are_anthropic_400s_before_anything_is_resolved(base: str,
                                                                     rec: AgentRecorder) -> None:
    sdk = anthropic_client(base)
    cases = [
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role: 'tool'"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "'document' block is not supported"),
        ({"messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "bash_20250124", "name": "bash"}]},
         "tool type 'bash_20250124'"),
        ({"messages": [{"role": "user", "content": "x"},
                       {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ]
    for fields, fragment in cases:
        with pytest.raises(anthropic.BadRequestError, match=re.escape(fragment)) as info:
            sdk.messages.create(model="native", max_tokens=4, **fields)
        assert info.value.body["type"] == "error"
        assert info.value.body["error"]["type"] == "invalid_request_error"
    assert rec.requests == []
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(model="claude-nope", max_tokens=4,
                            messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        anthropic_client(base, "sk-wrong").messages.create(model="native", max_tokens=4,
                                                 messages=[{"role": "user", "content": "x"}])
    assert unauthorized.value.body["type"] == "error"


def test_upstream_errors_keep_the_api_shape(base: str, rec: AgentRecorder) -> None:
    rec.error = (429, {"error": {"message": "slow down", "type": "rate_limit",
                                 "code": "rate_limited"}})
    with pytest.raises(anthropic.RateLimitError, match="slow down") as info:
        anthropic_client(base).messages.create(model="chat-only", max_tokens=4,
                                     messages=[{"role": "user", "content": "x"}])
    assert info.value.body == {"type": "error", "error": {"type": "rate_limit_error",
                                                          "message": "slow down"}}
    anthropic_error = {"type": "error", "error": {"type": "overloaded_error",
                                                  "message": "busy"}}
    rec.error = (529, anthropic_error)
    with pytest.raises(anthropic.APIStatusError) as native:
        anthropic_client(base).messages.create(model="native", max_tokens=4,
                                     messages=[{"role": "user", "content": "x"}])
    assert native.value.status_code == 529 and native.value.body == anthropic_error
    with pytest.raises(openai.RateLimitError):
        rec.error = (429, anthropic_error)
        openai_client(base, "sk-acme").responses.create(model="chat-only", input="x")


def test_a_relayed_stream_that_breaks_ends_with_an_anthropic_error_event(
        base: str, rec: AgentRecorder) -> None:
    rec.break_stream = True
    with local_client(base_url=base, headers={"x-api-key": "sk-acme"}) as http:
        with http.stream("POST", "/v1/messages", json={
                "model": "native", "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": "x"}]}) as response:
            lines = [line for line in response.iter_lines() if line]
    assert lines[0] == "event: message_start"
    assert lines[-2] == "event: error"
    error = json.loads(lines[-1].removeprefix("data: "))
    assert error["type"] == "error" and "mid-stream" in error["error"]["message"]


def test_a_model_without_upstream_or_engine_refuses_agent_requests(base: str) -> None:
    with pytest.raises(anthropic.BadRequestError, match="no upstream and no engine"):
        anthropic_client(base).messages.create(model="boundary-only", max_tokens=4,
                                     messages=[{"role": "user", "content": "x"}])


# -- OpenAI Responses -----------------------------------------------------------------------


def test_responses_go_unchanged_and_previous_response_id_follows_the_upstream(
        base: str, rec: AgentRecorder) -> None:
    sdk = openai_client(base, "sk-acme")
    system = unique_system()["content"]
    first = sdk.responses.create(model="native-spec", instructions=system,
                                 input="Read a.txt.", tools=[READ_RESPONSES])
    assert first.id.startswith("resp_rec_") and first.output_text == "recorded"
    sent = rec.last("responses").body
    assert {k: sent[k] for k in ("model", "instructions", "input", "tools")} == {
        "model": "native-spec", "instructions": system, "input": "Read a.txt.",
        "tools": [READ_RESPONSES]}
    assert sent["specprefill_namespace"] == "acme" and sent["specprefill_system_end"] > 0
    with sdk.responses.with_streaming_response.create(
            model="native-spec", instructions=system, input="And b.txt?",
            previous_response_id=first.id, tools=[READ_RESPONSES], stream=True) as response:
        assert response.headers["x-prefix-cache"] == "hit"
        events = list(response.parse())
    second_id = events[-1].response.id
    chat_messages = [{"role": "system", "content": system},
                     {"role": "user", "content": "Read a.txt."},
                     {"role": "assistant", "content": "recorded"},
                     {"role": "user", "content": "And b.txt?"}]
    expected = chat_boundary(base, {"model": "native-spec", "messages": chat_messages,
                                    "tools": [READ_CHAT]})
    sent = rec.last("responses").body
    assert sent["previous_response_id"] == first.id
    assert sent["prompt_token_ids"] == expected["prompt_ids"]
    assert sent["specprefill_system_end"] == expected["specprefill_system_end"] > 0
    # The relayed stream was kept too: a third turn continues from it.
    third = sdk.responses.with_raw_response.create(
        model="native-spec", instructions=system, input="Thanks.",
        previous_response_id=second_id, tools=[READ_RESPONSES])
    assert third.headers["x-prefix-cache"] == "hit"
    expected = chat_boundary(base, {"model": "native-spec", "messages": [
        *chat_messages, {"role": "assistant", "content": "recorded"},
        {"role": "user", "content": "Thanks."}], "tools": [READ_CHAT]})
    assert rec.last("responses").body["prompt_token_ids"] == expected["prompt_ids"]


def test_responses_become_chat_completions_with_function_calls(base: str,
                                                               rec: AgentRecorder) -> None:
    sdk = openai_client(base, "sk-acme")
    system = unique_system()["content"]
    rec.tool_call = ("call_3", "read_file", {"path": "a.txt"})
    first = sdk.responses.create(model="chat-only", instructions=system, input="Read a.txt.",
                                 tools=[READ_RESPONSES], max_output_tokens=16, temperature=0.2)
    assert [item.type for item in first.output] == ["message", "function_call"]
    call = first.output[1]
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("call_3", "read_file",
                                                                    {"path": "a.txt"})
    assert first.status == "completed" and first.usage.input_tokens_details.cached_tokens == 4
    sent = rec.last("chat").body
    assert sent == {"model": "chat-only", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "Read a.txt."}],
        "tools": [READ_CHAT], "max_tokens": 16, "temperature": 0.2}
    rec.tool_call = None
    with sdk.responses.stream(model="chat-only", instructions=system,
                              previous_response_id=first.id, tools=[READ_RESPONSES],
                              input=[{"type": "function_call_output", "call_id": "call_3",
                                      "output": "hello"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and final.output_text == "recorded"
    assert rec.last("chat").body["messages"][2:] == [
        {"role": "assistant", "content": "recorded", "tool_calls": [
            {"id": "call_3", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path":"a.txt"}'}}]},
        {"role": "tool", "tool_call_id": "call_3", "content": "hello"}]


def test_a_streamed_function_call_comes_back_as_responses_events(base: str,
                                                                 rec: AgentRecorder) -> None:
    rec.tool_call = ("call_5", "read_file", {"path": "d.txt"})
    with openai_client(base, "sk-acme").responses.stream(
            model="chat-only", input="Read d.txt.", tools=[READ_RESPONSES]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert kinds.index("response.output_text.done") < kinds.index(
        "response.function_call_arguments.done") < kinds.index("response.completed")
    assert [item.type for item in final.output] == ["message", "function_call"]
    call = final.output[1]
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("call_5", "read_file",
                                                                    {"path": "d.txt"})
    assert final.usage.output_tokens == 3 and final.status == "completed"


def test_response_ids_belong_to_their_tenant(base: str, rec: AgentRecorder) -> None:
    acme, globex = openai_client(base, "sk-acme"), openai_client(base, "sk-globex")
    first = acme.responses.create(model="chat-only", input="Remember 42.")
    with pytest.raises(openai.BadRequestError) as info:
        globex.responses.create(model="chat-only", input="What was it?",
                                previous_response_id=first.id)
    assert info.value.body["code"] == "previous_response_not_found"
    assert info.value.body["param"] == "previous_response_id"
    assert acme.responses.create(model="chat-only", input="What was it?",
                                 previous_response_id=first.id).status == "completed"
    # store=false keeps nothing
    unstored = acme.responses.create(model="chat-only", input="Forget me.", store=False)
    with pytest.raises(openai.BadRequestError, match="not found"):
        acme.responses.create(model="chat-only", input="x", previous_response_id=unstored.id)


def test_bad_responses_are_openai_400s(base: str, rec: AgentRecorder) -> None:
    sdk = openai_client(base, "sk-acme")
    cases = [
        ({"input": [{"role": "critic", "content": "x"}]}, "'critic' is not one of"),
        ({"input": "x", "tools": [{"type": "custom", "name": "patch"}]}, "tool type 'custom'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "'item_reference'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input_file|only input_text"),
        ({"input": "x", "background": True}, "background is not supported"),
    ]
    for fields, fragment in cases:
        with pytest.raises(openai.BadRequestError, match=fragment) as info:
            sdk.responses.create(model="chat-only", **fields)
        assert set(info.value.body) >= {"message", "type", "code"}
    assert rec.requests == []


def test_upstream_apis_come_from_the_models_file(tmp_path: Any, demo_folder: Any) -> None:
    from prefix_cache.service.served_models import load_model, load_model_specs

    models = tmp_path / "models.yaml"
    models.write_text(
        f"vllm:\n  folder: {demo_folder}\n  upstream: http://h:1/v1\n"
        f"  upstream_apis: [messages]\n"
        f"ours:\n  folder: {demo_folder}\n  upstream: http://h:2/v1\n"
        f"  upstream_kind: specprefill\n"
        f"plain:\n  folder: {demo_folder}\n  upstream: http://h:3/v1\n")
    specs = load_model_specs(ServiceSettings(models_file=models, keys_file=None))
    upstreams = [load_model(s, loader=lambda *_: None).upstream for s in specs]
    assert [u.apis for u in upstreams if u] == [("messages",), ("messages", "responses"), ()]
    models.write_text(f"bad:\n  folder: {demo_folder}\n  upstream: http://h:1/v1\n"
                      f"  upstream_apis: [completions]\n")
    with pytest.raises(ValueError, match="upstream_apis"):
        load_model_specs(ServiceSettings(models_file=models, keys_file=None))


# -- what goes upstream: only what the client sent, structured outputs included --------------


def test_no_sampling_field_the_client_did_not_send_goes_upstream(base: str,
                                                                 rec: AgentRecorder) -> None:
    """vLLM applies the model's generation config only to the fields a request leaves out."""
    anthropic_client(base).messages.create(model="chat-only", max_tokens=4,
                                 messages=[{"role": "user", "content": "x"}])
    with anthropic_client(base).messages.stream(model="chat-only", max_tokens=4,
                                      messages=[{"role": "user", "content": "x"}]) as stream:
        stream.until_done()
    sdk = openai_client(base, "sk-acme")
    sdk.responses.create(model="chat-only", input="x")
    with sdk.responses.stream(model="chat-only", input="x") as events:
        events.until_done()
    sent = [r.body for p, r in rec.requests if p == "chat"]
    assert len(sent) == 4
    for body in sent:
        assert not {"temperature", "top_p", "top_k", "seed"} & set(body), body
    anthropic_client(base).messages.create(model="chat-only", max_tokens=4, extra_body={"top_p": 0.5},
                                 messages=[{"role": "user", "content": "x"}])
    assert rec.last("chat").body["top_p"] == 0.5 and "temperature" not in rec.last("chat").body


def test_structured_outputs_reach_a_chat_only_upstream_as_response_format(
        base: str, rec: AgentRecorder) -> None:
    from pydantic import BaseModel

    class Trip(BaseModel):
        city: str
        days: int

    rec.text = '{"city": "Paris", "days": 3}'  # an upstream that honours the schema
    sdk = openai_client(base, "sk-acme")
    parsed = sdk.responses.parse(model="chat-only", input="Plan a trip.", text_format=Trip,
                                 reasoning={"effort": "low"})
    assert parsed.output_parsed == Trip(city="Paris", days=3)
    sent = rec.last("chat").body
    assert sent["response_format"]["type"] == "json_schema"
    schema = sent["response_format"]["json_schema"]
    assert schema["name"] == "Trip" and schema["strict"] is True
    assert schema["schema"]["properties"] == {"city": {"title": "City", "type": "string"},
                                              "days": {"title": "Days", "type": "integer"}}
    assert sent["reasoning_effort"] == "low"
    with sdk.responses.stream(model="chat-only", input="Plan it.", text_format=Trip) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == Trip(city="Paris", days=3)
    assert rec.last("chat").body["response_format"]["json_schema"]["name"] == "Trip"
    sdk.responses.create(model="chat-only", input="JSON please.",
                         text={"format": {"type": "json_object"}, "verbosity": "low"})
    assert rec.last("chat").body["response_format"] == {"type": "json_object"}
    assert rec.last("chat").body["verbosity"] == "low"
    # To an upstream that serves Responses itself, text goes as it was sent.
    sdk.responses.parse(model="native", input="Plan a trip.", text_format=Trip)
    assert rec.last("responses").body["text"]["format"]["name"] == "Trip"
    with pytest.raises(openai.BadRequestError, match="text.format"):
        sdk.responses.create(model="chat-only", input="x",
                             text={"format": {"type": "json_schema"}})


def test_a_missing_key_on_messages_is_a_401_that_names_x_api_key(base: str) -> None:
    with local_client(base_url=base) as http:
        messages = http.post("/v1/messages", json={
            "model": "native", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
        chat = http.post("/v1/chat/completions", json={
            "model": "native", "messages": [{"role": "user", "content": "x"}]})
    assert messages.status_code == 401
    assert messages.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in messages.json()["error"]["message"]
    assert chat.status_code == 401 and "Authorization: Bearer" in chat.json()["error"]["message"]


# -- stored responses: read, listed, deleted, per tenant --------------------------------------


def test_stored_responses_are_retrieved_listed_and_deleted_by_their_tenant(
        base: str, rec: AgentRecorder) -> None:
    acme, globex = openai_client(base, "sk-acme"), openai_client(base, "sk-globex")
    inputs = [{"role": "user", "content": "Read a.txt."},
              {"type": "message", "role": "user",
               "content": [{"type": "input_text", "text": "Then b.txt."}]},
              {"role": "user", "content": "Then c.txt."}]
    first = acme.responses.create(model="chat-only", instructions="Be brief.", input=inputs)
    got = acme.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    listed = list(acme.responses.input_items.list(first.id, limit=2))  # pages through
    assert [item.content[0].text for item in listed] == ["Then c.txt.", "Then b.txt.",
                                                         "Read a.txt."]
    assert len({item.id for item in listed}) == 3
    ascending = acme.responses.input_items.list(first.id, order="asc", limit=2)
    assert [i.content[0].text for i in ascending.data] == ["Read a.txt.", "Then b.txt."]
    assert ascending.has_more
    # Another tenant: the id does not exist for it, to read or to delete.
    for call in (lambda: globex.responses.retrieve(first.id),
                 lambda: globex.responses.input_items.list(first.id),
                 lambda: globex.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    # A relayed response (the upstream serves Responses) is kept and read the same way.
    relayed = acme.responses.create(model="native", input="Hi.")
    assert acme.responses.retrieve(relayed.id).output_text == "recorded"
    acme.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        acme.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        acme.responses.create(model="chat-only", input="x", previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError, match="stream"):
        acme.responses.retrieve(relayed.id, stream=True)


def test_an_unknown_previous_response_id_goes_to_an_upstream_that_keeps_responses(
        rec_server: tuple[AgentRecorder, str], rec: AgentRecorder, demo_tokenizer: Any) -> None:
    """After a sidecar restart (or on another worker or replica without the shared store) the
    sidecar does not know the id: the upstream, which serves Responses, decides."""
    url = rec_server[1]

    def sidecar() -> ServerThread:
        return ServerThread(sidecar_app(
            served("native", demo_tokenizer, Upstream(url, apis=("messages", "responses"))),
            served("native-spec", demo_tokenizer, Upstream(url, "specprefill")),
            served("chat-only", demo_tokenizer, Upstream(url)), api_keys=TENANT_KEYS))

    system = unique_system()["content"]
    with sidecar() as before:
        first = openai_client(before, "sk-acme").responses.create(
            model="native-spec", instructions=system, input="One.")
    with sidecar() as after:  # a fresh process's store: the id is unknown here
        sdk = openai_client(after, "sk-acme")
        second = sdk.responses.with_raw_response.create(
            model="native-spec", instructions=system, input="Two.",
            previous_response_id=first.id)
        assert second.parse().output_text == "recorded"
        sent = rec.last("responses").body
        assert sent["previous_response_id"] == first.id and sent["input"] == "Two."
        # The upstream renders the conversation it keeps; the static part's end still holds.
        assert "prompt_token_ids" not in sent
        assert sent["specprefill_system_end"] == int(second.headers["x-specprefill-system-end"])
        assert sent["specprefill_system_end"] > 0
        with sdk.responses.stream(model="native", input="Three.",
                                  previous_response_id=second.parse().id) as stream:
            assert stream.get_final_response().output_text == "recorded"
        assert rec.last("responses").body["previous_response_id"] == second.parse().id
        # A turn on an id the sidecar did not know is not kept here either: the upstream has it.
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(second.parse().id)
        # Where the sidecar answers itself (chat-only upstream), unknown is still a 400.
        with pytest.raises(openai.BadRequestError, match="not found"):
            sdk.responses.create(model="chat-only", input="x", previous_response_id=first.id)


@needs_redis
def test_with_redis_every_worker_and_replica_finds_stored_responses(
        rec_server: tuple[AgentRecorder, str], rec: AgentRecorder, demo_tokenizer: Any,
        redis: Any) -> None:
    """Two sidecars on one Redis (two workers, or two replicas): a response stored by one is
    chained on, read, listed and deleted through the other, per tenant, with a TTL."""
    url = rec_server[1]

    def sidecar() -> ServerThread:
        return ServerThread(sidecar_app(served("chat-only", demo_tokenizer, Upstream(url)),
                                        api_keys=TENANT_KEYS, redis_url=redis.url,
                                        responses_store_ttl_s=600.0))

    with sidecar() as one, sidecar() as two:
        first = openai_client(one, "sk-acme").responses.create(
            model="chat-only", instructions="Be brief.", input="Remember 42.")
        other = openai_client(two, "sk-acme")
        assert other.responses.retrieve(first.id).output_text == "recorded"
        assert [i.content[0].text for i in other.responses.input_items.list(first.id)] \
            == ["Remember 42."]
        second = other.responses.create(model="chat-only", input="What was it?",
                                         previous_response_id=first.id)
        assert rec.last("chat").body["messages"] == [
            {"role": "user", "content": "Remember 42."},
            {"role": "assistant", "content": "recorded"},
            {"role": "user", "content": "What was it?"}]
        with pytest.raises(openai.NotFoundError):
            openai_client(one, "sk-globex").responses.retrieve(first.id)
        ttl = int(redis.cli("TTL", f"prefix-cache-responses:{{acme}}:{second.id}"))
        assert 0 < ttl <= 600
        other.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):  # gone for every worker at once
            openai_client(one, "sk-acme").responses.retrieve(first.id)


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=needs_redis)])
def test_a_response_finishing_after_its_tenants_purge_is_not_stored(
        store: str, rec_server: tuple[AgentRecorder, str], rec: AgentRecorder,
        demo_tokenizer: Any, request: pytest.FixtureRequest) -> None:
    """Issue 47, defect 2, for stored responses: acme's and globex's responses are in flight
    (the upstream holds them) when a purge of acme answers; then both finish. acme's is not
    kept (a 404, no key of acme's left in Redis), globex's is, and acme's next response is
    stored as usual. With Redis, the purge goes through one sidecar and the responses through
    another: the fence holds across replicas."""
    redis = request.getfixturevalue("redis") if store == "redis" else None
    settings: dict[str, Any] = {"api_keys": TENANT_KEYS, "admin_keys": [PURGE_ADMIN_KEY]}
    if redis is not None:
        settings["redis_url"] = redis.url

    def sidecar() -> ServerThread:
        return ServerThread(sidecar_app(served("chat-only", demo_tokenizer,
                                               Upstream(rec_server[1])), **settings))

    with sidecar() as one, sidecar() as two:
        admin_base = two if redis is not None else one  # a memory store is this process's
        rec.hold = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            pending = {key: pool.submit(openai_client(one, key).responses.create,
                                        model="chat-only", input=f"Remember {key}.")
                       for key in ("sk-acme", "sk-globex")}
            deadline = time.monotonic() + 30
            while len(rec.arrived_at) < 2:  # both are at the upstream, answers held
                assert time.monotonic() < deadline, "the responses never reached the upstream"
                time.sleep(0.01)
            with local_client(base_url=admin_base, headers=bearer(PURGE_ADMIN_KEY)) as http:
                r = http.post("/admin/purge", json={"tenant": "acme"})
            assert r.status_code == 200, r.text
            rec.hold.set()
            acme, globex = (pending[k].result(timeout=30) for k in ("sk-acme", "sk-globex"))
        assert acme.output_text == "recorded"  # answered, only not kept
        with pytest.raises(openai.NotFoundError):
            openai_client(one, "sk-acme").responses.retrieve(acme.id)
        assert openai_client(one, "sk-globex").responses.retrieve(globex.id).id == globex.id
        if redis is not None:
            assert [k for k in redis.client().scan_iter("prefix-cache-responses:*")
                    if b"acme" in k] == []
        later = openai_client(one, "sk-acme").responses.create(model="chat-only", input="Hi.")
        assert openai_client(one, "sk-acme").responses.retrieve(later.id).id == later.id


# -- what the model writes: malformed tool calls; the usage of a stream ----------------------


def test_malformed_tool_call_arguments_come_back_as_text_never_a_5xx(
        base: str, rec: AgentRecorder) -> None:
    """A small model's ``{path: a.txt``: the turn comes back (200) with the call as the text
    it was, streamed or not, and ends its turn; the SDK's final message is whole."""
    rec.tool_call = ("call_1", "read_file", {})
    rec.raw_arguments = "{path: a.txt"
    as_text = 'recorded{"name": "read_file", "arguments": {path: a.txt}'
    ask = {"model": "chat-only", "max_tokens": 8, "tools": [READ],
           "messages": [{"role": "user", "content": "Read a.txt."}]}
    message = anthropic_client(base).messages.create(**ask)
    assert [(b.type, b.text) for b in message.content] == [("text", as_text)]
    assert message.stop_reason == "end_turn"
    with anthropic_client(base).messages.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", as_text)]
    assert final.stop_reason == "end_turn" and "input_json" not in kinds
    # A valid call is a tool_use block, held until whole and sent as one input_json_delta.
    rec.raw_arguments = None
    rec.tool_call = ("call_2", "read_file", {"path": "a.txt", "n": 2**70})
    with anthropic_client(base).messages.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds.count("input_json") == 1 and final.stop_reason == "tool_use"
    assert final.content[1].input == {"path": "a.txt", "n": 2**70}
    # Responses carries arguments as text: they come back as they were.
    rec.raw_arguments = "{path: a.txt"
    response = openai_client(base, "sk-acme").responses.create(
        model="chat-only", input="Read a.txt.", tools=[READ_RESPONSES])
    assert response.output[1].arguments == "{path: a.txt"


def sse_events(base: str, body: dict[str, Any]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """A streamed /v1/messages answer's headers and events, read raw."""
    with local_client(base_url=base, headers={"x-api-key": "sk-acme"}) as http:
        with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            headers = dict(response.headers)
    return headers, [json.loads(line.removeprefix("data: ")) for line in lines]


def test_an_anthropic_stream_reports_what_the_upstream_reused(base: str,
                                                               rec: AgentRecorder) -> None:
    """On a hit of the static prefix, a chat-only upstream may still compute every token:
    message_start claims nothing read (the prompt's length, as known then) and message_delta
    has the upstream's own counts at the end, which the SDK's final message keeps -- never
    the boundary (issue 54: the upstream said 13,478 prompt tokens, 0 cached)."""
    system = unique_system()["content"]
    body = {"model": "chat-only", "max_tokens": 8, "system": system, "tools": [READ],
            "messages": [{"role": "user", "content": "Read a.txt."}]}
    count = anthropic_client(base).messages.count_tokens(model="chat-only", system=system,
                                                         tools=[READ], messages=body["messages"])
    n = count.input_tokens
    rec.usage = (n, 3, 0)  # the upstream computed every token
    headers, events = sse_events(base, body)  # count_tokens resolved it: a hit
    assert headers["x-prefix-cache"] == "hit" and int(headers["x-specprefill-system-end"]) > 0
    start = events[0]["message"]["usage"]
    assert start == {"input_tokens": n, "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": 0, "output_tokens": 0}
    delta = [e for e in events if e["type"] == "message_delta"][0]["usage"]
    assert delta == {**start, "output_tokens": 3}
    rec.usage = (n, 3, 5)  # the upstream reused 5 (its own prefix cache)
    with anthropic_client(base).messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens,
            final.usage.output_tokens) == (n - 5, 5, 3)
    message = anthropic_client(base).messages.create(**body)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (n - 5, 5)


def test_fields_only_a_native_upstream_honours_are_refused_where_converted(
        base: str, rec: AgentRecorder) -> None:
    sdk = openai_client(base, "sk-acme")
    with pytest.raises(openai.BadRequestError, match="max_tool_calls") as info:
        sdk.responses.create(model="chat-only", input="x", max_tool_calls=2)
    assert info.value.body["code"] == "unsupported_parameter"
    with pytest.raises(anthropic.BadRequestError, match="mcp_servers"):
        anthropic_client(base).messages.create(model="chat-only", max_tokens=4, messages=[
            {"role": "user", "content": "x"}], extra_body={"mcp_servers": [{"name": "m"}]})
    assert rec.requests == []  # refused before anything went upstream
    sdk.responses.create(model="native", input="x", max_tool_calls=2)
    assert rec.last("responses").body["max_tool_calls"] == 2  # there: as it was sent

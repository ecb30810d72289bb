"""What the agent command-line clients send at their defaults (Claude Code's Messages body,
Codex's Responses body: ``tests/support/agent_clients.py``), through the sidecar to a
recording upstream and on the in-process MLX engine, with the real ``anthropic`` and
``openai`` SDKs: every field accepted; Claude Code's mid-conversation ``system`` message folded
into a user turn, outside the static prefix and its key; Codex's namespaces callable and their
calls back in the shape sent; hosted tools left out and said so, or refused when the operator
asks, or passed through to an upstream that runs them. (The same bodies on the engine:
``test_engine.py``, which has the engine already loaded.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from prefix_cache.chat.anthropic_params import messages_conversation
from prefix_cache.chat.conversation import fold_late_system
from prefix_cache.service.upstream import Upstream

from tests.support.agent_clients import (
    DROPPED,
    ENV_BLOCK,
    claude_code_fields,
    codex_fields,
    create_message,
    sdk_fields,
)
from tests.support.agent_upstream import AgentRecorder
from tests.support.loopback import anthropic_client, local_client, openai_client
from tests.support.server_thread import ServerThread
from tests.support.sidecar import TENANT_KEYS, served, sidecar_app, unique_system

anthropic = pytest.importorskip("anthropic", reason="the Anthropic SDK is the client under test")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

@pytest.fixture(scope="module")
def app(agent_app: Any) -> Any:
    return agent_app  # the sidecar the module's ``base`` serves (tests/support/service_fixtures)


def test_the_fold_keeps_static_messages_and_every_template_s_order() -> None:
    """The rule, case by case: the static prefix as it is; a late system message joins the
    user turn before it, else the next one, else becomes a user turn."""
    system = {"role": "system", "content": "S"}
    late = {"role": "system", "content": "E"}
    user, assistant = {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}
    tool = {"role": "tool", "tool_call_id": "c", "content": "T"}
    assert fold_late_system([system, user, late, assistant]) == [
        system, {"role": "user", "content": "U\nE"}, assistant]
    assert fold_late_system([system, user, assistant, tool, late, user]) == [
        system, user, assistant, tool, {"role": "user", "content": "E\nU"}]
    assert fold_late_system([system, user, assistant, late]) == [
        system, user, assistant, {"role": "user", "content": "E"}]
    # Anthropic's static prefix is the top-level system only: a leading one in messages is not.
    assert fold_late_system([late, user], static=0) == [{"role": "user", "content": "E\nU"}]
    assert fold_late_system([{"role": "developer", "content": "D"}, user]) == [
        {"role": "developer", "content": "D"}, user]


def test_claude_code_s_request_goes_as_a_chat_completion(base: str, rec: AgentRecorder) -> None:
    system = unique_system()["content"]
    sdk = anthropic_client(base)
    raw, events = create_message(sdk, claude_code_fields(system, model="chat-only"))
    assert raw.status_code == 200 and raw.headers["x-prefix-cache"] == "miss"
    boundary = int(raw.headers["x-specprefill-system-end"])
    assert boundary > 0 and events[-1]["type"] == "message_stop"
    sent = rec.last("chat").body
    assert sent["messages"] == [
        {"role": "system", "content": system},  # the billing header dropped, as before
        {"role": "user", "content": "<system-reminder>Use the tools.</system-reminder>\n"
                                    f"Read a.txt.\n{ENV_BLOCK}"}]
    assert "thinking" not in sent and "context_management" not in sent
    # Another environment block (another day, another folder): the same key, a hit.
    raw, _ = create_message(sdk, claude_code_fields(system, env="<env>elsewhere</env>",
                                                    model="chat-only"))
    assert raw.headers["x-prefix-cache"] == "hit"
    assert int(raw.headers["x-specprefill-system-end"]) == boundary


def test_claude_code_s_request_goes_unchanged_to_an_upstream_serving_messages(
        base: str, rec: AgentRecorder) -> None:
    fields = claude_code_fields(unique_system()["content"], model="native")
    with local_client(base_url=base, headers={"x-api-key": "sk-acme"}) as http:
        r = http.post("/v1/messages?beta=true", json=fields)
    assert r.status_code == 200, r.text
    assert rec.last("messages").body == fields
    assert DROPPED not in r.headers


def test_a_mid_conversation_system_message_is_never_static() -> None:
    """Without a top-level system, a system message first in ``messages`` is not the static
    prefix either: the conversation has no static part."""
    conversation = messages_conversation({"messages": [
        {"role": "system", "content": ENV_BLOCK}, {"role": "user", "content": "hi"}]})
    assert conversation.messages == [{"role": "user", "content": f"{ENV_BLOCK}\nhi"}]


def test_codex_s_request_goes_as_a_chat_completion(base: str, rec: AgentRecorder) -> None:
    developer = unique_system()["content"]
    sdk = openai_client(base, "sk-acme")
    fields = codex_fields(developer)
    rec.tool_call = ("call_1", "multi_agent.spawn_agent", {"task": "count the files"})
    raw = sdk.responses.with_raw_response.create(**sdk_fields(sdk.responses.create, {
        **fields, "model": "chat-only", "stream": False}))
    assert raw.headers["x-prefix-cache"] == "miss"
    assert raw.headers[DROPPED] == "web_search"
    sent = rec.last("chat").body
    assert [t["function"]["name"] for t in sent["tools"]] == [
        "shell", "read_file", "multi_agent.spawn_agent", "multi_agent.close_agent"]
    assert sent["messages"][0] == {"role": "developer", "content": developer}
    assert sent["reasoning_effort"] == "medium"
    for field in ("include", "store", "prompt_cache_key", "client_metadata", "max_tokens"):
        assert field not in sent
    call = raw.parse().output[-1]
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn_agent",
                                                      "multi_agent")
    assert json.loads(call.arguments) == {"task": "count the files"}
    # Streamed, as Codex asks: the call in the shape sent, in every event that carries it.
    with sdk.responses.create(**sdk_fields(sdk.responses.create,
                                           {**fields, "model": "chat-only"})) as stream:
        done = [e.item for e in stream if e.type == "response.output_item.done"]
    assert [(i.name, i.namespace) for i in done if i.type == "function_call"] == [
        ("spawn_agent", "multi_agent")]
    # Its next turn: the call as it went back, and its output; the static prefix a hit.
    rec.tool_call = None
    turn = [*fields["input"], {"type": "function_call", "call_id": "call_1",
                               "name": "spawn_agent", "namespace": "multi_agent",
                               "arguments": call.arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "agent a1"}]
    raw = sdk.responses.with_raw_response.create(**sdk_fields(sdk.responses.create, {
        **fields, "model": "chat-only", "stream": False, "input": turn}))
    assert raw.headers["x-prefix-cache"] == "hit"
    calls = [m for m in rec.last("chat").body["messages"] if m.get("tool_calls")]
    assert calls[0]["tool_calls"][0]["function"]["name"] == "multi_agent.spawn_agent"


def test_hosted_tools_go_to_an_upstream_serving_responses(base: str,
                                                          rec: AgentRecorder) -> None:
    fields = {**codex_fields(unique_system()["content"]), "model": "native", "stream": False}
    sdk = openai_client(base, "sk-acme")
    raw = sdk.responses.with_raw_response.create(**sdk_fields(sdk.responses.create, fields))
    assert DROPPED not in raw.headers
    assert rec.last("responses").body == fields  # web_search and the namespace as sent


def test_the_operator_may_refuse_hosted_tools(rec_server: tuple[AgentRecorder, str],
                                              demo_tokenizer: Any) -> None:
    strict = sidecar_app(served("chat-only", demo_tokenizer, Upstream(rec_server[1])),
                         api_keys=TENANT_KEYS, strict_hosted_tools=True)
    fields = {**codex_fields(unique_system()["content"]), "model": "chat-only", "stream": False}
    with ServerThread(strict) as url:
        sdk = openai_client(url, "sk-acme")
        with pytest.raises(openai.BadRequestError, match="web_search") as info:
            sdk.responses.create(**sdk_fields(sdk.responses.create, fields))
        assert info.value.code == "unsupported_parameter"
        fields["tools"] = fields["tools"][:3]
        answer = sdk.responses.create(**sdk_fields(sdk.responses.create, fields))
        assert answer.status == "completed"


def test_hosted_tools_alone_leave_a_request_without_tools() -> None:
    from prefix_cache.chat.anthropic_params import parse_messages_body
    from prefix_cache.chat.responses_params import parse_responses_body

    responses = parse_responses_body({"input": "x", "tools": [{"type": "web_search"}]},
                                     lambda _: None).call
    assert (responses.conversation.tools, responses.hosted_tools) == (None, ("web_search",))
    messages = parse_messages_body({"model": "m", "max_tokens": 1, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}],
        "messages": [{"role": "user", "content": "x"}]})
    assert (messages.conversation.tools, messages.hosted_tools) == (
        None, ("web_search_20250305",))


def test_an_upstream_default_limit_where_the_client_sends_none(
        rec_server: tuple[AgentRecorder, str], demo_tokenizer: Any) -> None:
    """``upstream_default_max_tokens``: a request naming no limit gets it, in its API's field
    (chat relayed, Responses relayed or converted); one naming a limit goes as it came."""
    rec, url = rec_server
    rec.reset()
    app = sidecar_app(
        served("chat-only", demo_tokenizer, Upstream(url, default_max_tokens=64)),
        served("native", demo_tokenizer, Upstream(url, apis=("responses",),
                                                  default_max_tokens=64)),
        api_keys=TENANT_KEYS)
    with ServerThread(app) as base:
        sdk = openai_client(base, "sk-acme")
        sdk.chat.completions.create(model="chat-only", messages=[{"role": "user",
                                                                  "content": "x"}])
        assert rec.last("chat").body["max_tokens"] == 64
        raw = json.dumps({"model": "chat-only", "max_completion_tokens": 5, "messages": [
            {"role": "user", "content": "x"}]}, indent=1).encode()
        headers = {"authorization": "Bearer sk-acme", "content-type": "application/json"}
        with local_client(base_url=base, headers=headers) as http:
            assert http.post("/v1/chat/completions", content=raw).status_code == 200
        assert rec.last("chat").raw == raw  # a limit named: byte for byte
        fields = {**codex_fields(unique_system()["content"]), "stream": False}
        sdk.responses.create(**sdk_fields(sdk.responses.create, {**fields, "model": "chat-only"}))
        assert rec.last("chat").body["max_tokens"] == 64
        sdk.responses.create(**sdk_fields(sdk.responses.create, {**fields, "model": "native"}))
        assert rec.last("responses").body["max_output_tokens"] == 64

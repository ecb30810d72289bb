"""The agent APIs on the MLX engine: in-process behind the sidecar (``serve --engine mlx``), as
the engine's own server (``serve-engine``), and a sidecar in front of that -- with the real
``anthropic`` and ``openai`` SDKs as clients, on the tiny random-weights model (so what is
checked is plumbing, counts, boundaries and KV reuse, never text)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import re
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
anthropic = pytest.importorskip("anthropic", reason="the Anthropic SDK is the client under test")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

from engine_adapter.backend import MLXBackend  # noqa: E402
from engine_adapter.server import create_engine_app  # noqa: E402
from prefix_cache.chat.anthropic_encode import MessageMeta, message_json  # noqa: E402
from prefix_cache.chat.events import backend_events  # noqa: E402
from prefix_cache.engine.protocol import BackendRequest, SamplingParams, Usage  # noqa: E402
from prefix_cache.model_folders.model_dir import load_tokenizer  # noqa: E402
from prefix_cache.service.upstream import Upstream  # noqa: E402
from tests.support.agent_clients import (  # noqa: E402
    DROPPED,
    claude_code_fields,
    codex_fields,
    create_message,
    sdk_fields,
)
from tests.support.agent_upstream import READ, READ_CHAT, READ_RESPONSES  # noqa: E402
from tests.support.loopback import anthropic_client, openai_client  # noqa: E402
from tests.support.scripted_engine import ScriptedEngine  # noqa: E402
from tests.support.server_thread import ServerThread  # noqa: E402
from tests.support.service_fixtures import TINY_MODEL  # noqa: E402
from tests.support.sidecar import TENANT_KEYS, served, sidecar_app, unique_system  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

META = MessageMeta("msg_1", "m", Usage(3, 0))


def chat_completion(base: str, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> tuple[int, int]:
    """The boundary /v1/chat/completions gives for a conversation, and its prompt's length."""
    raw = openai_client(base, "sk-acme").chat.completions.with_raw_response.create(
        model=TINY_MODEL, messages=messages, tools=tools or openai.omit, max_tokens=1,
        temperature=0.0)
    return int(raw.headers["x-specprefill-system-end"]), raw.parse().usage.prompt_tokens


def test_an_anthropic_agent_on_the_in_process_engine(
        engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, engine = engine_sidecar
    sdk = anthropic_client(url)
    system = unique_system()["content"]
    blocks = [{"type": "text", "text": system[:12]}, {"type": "text", "text": system[12:]}]
    first = sdk.messages.with_raw_response.create(
        model=TINY_MODEL, max_tokens=4, system=blocks, tools=[READ],
        messages=[{"role": "user", "content": "Read a.txt."}])
    assert first.headers["x-prefix-cache"] == "miss"
    message = first.parse()
    assert message.type == "message" and message.role == "assistant" and message.model == TINY_MODEL
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.output_tokens <= 4
    # The agent's second turn: its tool call and the tool's result.
    turns = [{"role": "user", "content": "Read a.txt."},
             {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                  "input": {"path": "a.txt"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello"}]}]
    before = engine.snapshot_stats().reused_tokens
    second = sdk.messages.with_raw_response.create(model=TINY_MODEL, max_tokens=4, system=blocks,
                                                   tools=[READ], messages=turns)
    assert second.headers["x-prefix-cache"] == "hit"
    end = int(second.headers["x-specprefill-system-end"])
    usage = second.parse().usage
    assert usage.cache_read_input_tokens >= end > 0          # the static KV, at least, reused
    assert engine.snapshot_stats().reused_tokens - before == usage.cache_read_input_tokens
    chat_end, chat_prompt = chat_completion(url, [
        {"role": "system", "content": system},
        {"role": "user", "content": "Read a.txt."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "read_file", "arguments": {"path": "a.txt"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "hello"}], [READ_CHAT])
    assert (chat_end, chat_prompt) == (end, usage.input_tokens + usage.cache_read_input_tokens)


def test_anthropic_streaming_on_the_in_process_engine(
        engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, _ = engine_sidecar
    with anthropic_client(url).messages.stream(
            model=TINY_MODEL, max_tokens=5, system=unique_system()["content"],
            messages=[{"role": "user", "content": "Stream."}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    # One usage: the engine's own counts at message_start, repeated by message_delta.
    start = events[0].message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert (delta.input_tokens, delta.cache_read_input_tokens) \
        == (start.input_tokens, start.cache_read_input_tokens) \
        == (final.usage.input_tokens, final.usage.cache_read_input_tokens)
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "text" in kinds and final.content[0].type == "text" and final.content[0].text
    assert final.stop_reason in ("max_tokens", "end_turn")
    assert 1 <= final.usage.output_tokens <= 5 and final.usage.input_tokens > 0


def test_the_engine_refuses_what_it_cannot_honour(engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, _ = engine_sidecar
    with pytest.raises(anthropic.BadRequestError, match="top_k") as info:
        anthropic_client(url).messages.create(model=TINY_MODEL, max_tokens=4, extra_body={"top_k": 5},
                                    messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    # A schema the engine's constrained decoding cannot hold: refused, named in each API's terms.
    lookaround = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)"}}}
    with pytest.raises(openai.BadRequestError, match="text.format.schema") as refused:
        openai_client(url, "sk-acme").responses.create(
            model=TINY_MODEL, input="x", text={"format": {
                "type": "json_schema", "name": "x", "schema": lookaround}})
    assert refused.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\].function.parameters"):
        openai_client(url, "sk-acme").chat.completions.create(
            model=TINY_MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
            tool_choice="required", tools=[{"type": "function", "function": {
                "name": "f", "parameters": lookaround}}])
    with pytest.raises(anthropic.BadRequestError, match="output_config.format.schema"):
        anthropic_client(url).messages.create(
            model=TINY_MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}],
            extra_body={"output_config": {"format": {"type": "json_schema",
                                                     "schema": lookaround}}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        openai_client(url, "sk-acme").chat.completions.create(
            model=TINY_MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
            tool_choice="required")
    # Not served, as docs/agent-apis.md says: a 404 (not the 405 of the stored responses' path).
    with pytest.raises(openai.NotFoundError):
        openai_client(url, "sk-acme").responses.input_tokens.count(model=TINY_MODEL, input="x")
    with pytest.raises(openai.BadRequestError, match="text.verbosity"):
        openai_client(url, "sk-acme").responses.create(model=TINY_MODEL, input="x",
                                                       text={"verbosity": "low"})


def test_a_responses_agent_on_the_in_process_engine(engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, _ = engine_sidecar
    acme = openai_client(url, "sk-acme")
    system = unique_system()["content"]
    first = acme.responses.with_raw_response.create(
        model=TINY_MODEL, instructions=system, input="Read a.txt.", tools=[READ_RESPONSES],
        max_output_tokens=4, temperature=0.0)
    assert first.headers["x-prefix-cache"] == "miss"
    response = first.parse()
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    assert response.tools[0].name == "read_file" and response.instructions == system
    text = response.output_text
    with acme.responses.with_streaming_response.create(
            model=TINY_MODEL, instructions=system, input="And b.txt?", tools=[READ_RESPONSES],
            previous_response_id=response.id, max_output_tokens=4, temperature=0.0,
            stream=True) as streamed:
        assert streamed.headers["x-prefix-cache"] == "hit"
        end = int(streamed.headers["x-specprefill-system-end"])
        events = list(streamed.parse())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.previous_response_id == response.id
    assert final.usage.input_tokens_details.cached_tokens >= end > 0
    chat_end, chat_prompt = chat_completion(url, [
        {"role": "system", "content": system}, {"role": "user", "content": "Read a.txt."},
        {"role": "assistant", "content": text}, {"role": "user", "content": "And b.txt?"}],
        [READ_CHAT])
    assert (chat_end, chat_prompt) == (end, final.usage.input_tokens)
    # Another tenant does not know the id.
    with pytest.raises(openai.BadRequestError, match="not found"):
        openai_client(url, "sk-globex").responses.create(
            model=TINY_MODEL, input="x", previous_response_id=response.id)


def test_leaving_an_agent_stream_cancels_the_engine_request(
        engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, engine = engine_sidecar
    cancelled = engine.snapshot_stats().cancelled
    with anthropic_client(url).messages.stream(model=TINY_MODEL, max_tokens=30_000,
                                     messages=[{"role": "user", "content": "Go on."}]) as stream:
        for event in stream:
            if event.type == "text":
                break
    assert wait_until(lambda: engine.snapshot_stats().cancelled > cancelled)
    assert wait_until(lambda: engine.snapshot_stats().active == 0)


async def test_a_stop_sequence_is_reported_as_anthropic_does(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode("Hello world. The END is near.", add_special_tokens=False)
    backend = MLXBackend(ScriptedEngine(ids, stop_token_ids=()), tokenizer)
    request = backend.check(BackendRequest([1, 2, 3], 2, sampling=SamplingParams(
        max_tokens=50, stop=("never", "END"))))
    message = await message_json(META, backend_events(backend, request))
    assert message["content"] == [{"type": "text", "text": "Hello world. The "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")


# -- serve-engine, and a sidecar in front of it ---------------------------------------------


@pytest.fixture(scope="module")
def engine_server(tiny_model_dir: Path) -> Iterator[tuple[str, MLXBackend]]:
    chat_engine = MLXBackend.load(tiny_model_dir, name="tiny-engine")
    app = create_engine_app(chat_engine, trust_namespace=True, api_key="sk-engine")
    with ServerThread(app) as url:
        yield url, chat_engine


def test_serve_engine_serves_both_agent_apis(engine_server: tuple[str, MLXBackend]) -> None:
    url, _ = engine_server
    message = anthropic_client(url, "sk-engine").messages.create(
        model="anything", max_tokens=3, system="Be brief.", tools=[READ],
        messages=[{"role": "user", "content": "Hi"}])
    assert message.model == "anything" and message.usage.output_tokens <= 3
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(url, "sk-wrong").messages.create(model="m", max_tokens=3,
                                                messages=[{"role": "user", "content": "Hi"}])
    count = anthropic_client(url, "sk-engine").messages.count_tokens(
        model="anything", system="Be brief.", tools=[READ],
        messages=[{"role": "user", "content": "Hi"}])
    assert count.input_tokens == message.usage.input_tokens  # nothing cached yet: all of it
    sdk = openai_client(url, "sk-engine")
    first = sdk.responses.create(model="tiny-engine", input="Hi", max_output_tokens=3)
    second = sdk.responses.create(model="tiny-engine", input="Again", max_output_tokens=3,
                                  previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model="tiny-engine", input="x", previous_response_id="resp_nope")
    assert info.value.body["code"] == "previous_response_not_found"


def test_serve_engine_reads_and_deletes_stored_responses_per_namespace(
        engine_server: tuple[str, MLXBackend]) -> None:
    """The same routes as the sidecar's (one router); the namespace is the query's
    specprefill_namespace, trusted here as the body field is (--trust-namespace)."""
    url, _ = engine_server
    sdk = openai_client(url, "sk-engine")
    first = sdk.responses.create(model="tiny-engine", input="Hi", max_output_tokens=2,
                                 extra_body={"specprefill_namespace": "acme"})
    acme = {"specprefill_namespace": "acme"}
    got = sdk.responses.retrieve(first.id, extra_query=acme)
    assert got.id == first.id and got.output == first.output
    items = sdk.responses.input_items.list(first.id, extra_query=acme).data
    assert [(i.role, i.content[0].text) for i in items] == [("user", "Hi")]
    with pytest.raises(openai.NotFoundError):  # another namespace (here: "default")
        sdk.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(first.id, extra_query={"specprefill_namespace": "globex"})
    with pytest.raises(openai.AuthenticationError):
        openai_client(url, "sk-wrong").responses.retrieve(first.id, extra_query=acme)
    sdk.responses.delete(first.id, extra_query=acme)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id, extra_query=acme)


def test_a_sidecar_in_front_of_serve_engine_passes_agent_requests_natively(
        engine_server: tuple[str, MLXBackend], tiny_model_dir: Path) -> None:
    engine_url, chat_engine = engine_server
    tokenizer = load_tokenizer(tiny_model_dir)
    upstream = Upstream(engine_url, "specprefill", api_key="sk-engine")
    system = unique_system()["content"]
    app = sidecar_app(served("tiny", tokenizer, upstream), api_keys=TENANT_KEYS)
    with ServerThread(app) as url:
        sdk = openai_client(url, "sk-acme")
        first = sdk.responses.create(model="tiny", instructions=system, input="One.",
                                     tools=[READ_RESPONSES], max_output_tokens=3)
        before = chat_engine.snapshot_stats().reused_tokens
        second = sdk.responses.with_raw_response.create(
            model="tiny", instructions=system, input="Two.", tools=[READ_RESPONSES],
            previous_response_id=first.id, max_output_tokens=3)
        assert second.headers["x-prefix-cache"] == "hit"
        end = int(second.headers["x-specprefill-system-end"])
        usage = second.parse().usage
        assert usage.input_tokens_details.cached_tokens >= end > 0
        assert chat_engine.snapshot_stats().reused_tokens - before \
            == usage.input_tokens_details.cached_tokens
        with anthropic_client(url).messages.stream(model="tiny", max_tokens=3, system=system,
                                         tools=[READ],
                                         messages=[{"role": "user", "content": "Hi"}]) as s:
            final = s.get_final_message()
        # The same static prefix through the other API: acme's static KV, on the engine.
        assert final.usage.cache_read_input_tokens >= end
        assert "acme" in chat_engine.snapshot_stats().kv_store.by_namespace


# -- tool calls cut out of the engine's text ------------------------------------------------


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model's tokenizer as mlx-lm loads it for a model whose configuration names
    its tool-call format (Qwen's ``<tool_call>`` JSON, mlx-lm's ``json_tools``)."""
    import json
    import shutil

    from mlx_lm.tokenizer_utils import load

    folder = tmp_path_factory.mktemp("tool-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**config, "tool_parser_type": "json_tools"}))
    wrapper = load(folder)
    assert wrapper.tool_call_start == "<tool_call>"
    return wrapper


def scripted(tokenizer: Any, text: str) -> MLXBackend:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
    return MLXBackend(ScriptedEngine(ids, stop_token_ids=(eos,), finish="stop"), tokenizer)


async def keep_nothing(_: Any) -> None:
    """A response kept nowhere."""


CALL_TEXT = ('Sure.<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n'
             '</tool_call>')


async def test_tool_calls_are_cut_out_of_the_engine_text(tool_tokenizer: Any) -> None:
    from prefix_cache.chat.openai_encode import ChatMeta, completion_json
    from prefix_cache.chat.responses_encode import ResponseMeta, response_json

    backend = scripted(tool_tokenizer, CALL_TEXT)
    request = backend.check(BackendRequest([1, 2, 3], 2, tools=[READ_CHAT]))
    message = await message_json(META, backend_events(backend, request))
    assert message["content"][0] == {"type": "text", "text": "Sure."}
    call = message["content"][1]
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "read_file",
                                                           {"path": "a.txt"})
    assert message["stop_reason"] == "tool_use"
    chat = await completion_json(ChatMeta("m"), backend_events(
        backend, backend.check(BackendRequest([1, 2, 3], 2, tools=[READ_CHAT]))))
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "read_file", "arguments": '{"path": "a.txt"}'}
    response = await response_json(ResponseMeta("resp_1", "m"), backend_events(
        backend, backend.check(BackendRequest([1, 2, 3], 2, tools=[READ_CHAT]))), keep_nothing)
    assert [item["type"] for item in response["output"]] == ["message", "function_call"]
    assert response["output"][1]["name"] == "read_file"


@pytest.mark.parametrize("text, tools", [
    (CALL_TEXT, None),                                            # no tools offered: text
    ('Sure.<tool_call>\n{"name": broken}\n</tool_call>', [READ_CHAT]),   # unreadable call
    ('Sure.<tool_call>\n{"name": "read_file"', [READ_CHAT]),            # cut off
])
async def test_what_is_not_a_tool_call_stays_text(tool_tokenizer: Any, text: str,
                                                  tools: Any) -> None:
    backend = scripted(tool_tokenizer, text)
    request = backend.check(BackendRequest([1, 2, 3], 2, tools=tools))
    message = await message_json(META, backend_events(backend, request))
    assert message["content"] == [{"type": "text", "text": text}]
    assert message["stop_reason"] == "end_turn"


# -- what the agent clients send (tests/support/agent_clients.py), on the engine ------------


def test_claude_code_s_request_on_the_engine(engine_sidecar: tuple[str, MLXBackend]) -> None:
    engine_url = engine_sidecar[0]
    sdk = anthropic_client(engine_url)
    system = unique_system()["content"]
    raw, events = create_message(sdk, claude_code_fields(system, model=TINY_MODEL,
                                                         max_tokens=3))
    assert raw.headers["x-prefix-cache"] == "miss" and events[-1]["type"] == "message_stop"
    boundary = raw.headers["x-specprefill-system-end"]
    raw, events = create_message(sdk, claude_code_fields(system, env="<env>elsewhere</env>",
                                                         model=TINY_MODEL, max_tokens=3))
    assert raw.headers["x-prefix-cache"] == "hit"
    assert raw.headers["x-specprefill-system-end"] == boundary
    usage = [e for e in events if e["type"] == "message_delta"][-1]["usage"]
    assert usage["cache_read_input_tokens"] >= int(boundary)  # the engine's own reuse
    # Claude Code asks for 32,000 tokens (here the whole context): over what the context
    # leaves, in the words its retry reads (it lowers max_tokens to what is left).
    with pytest.raises(anthropic.BadRequestError) as info:
        create_message(sdk, claude_code_fields(system, model=TINY_MODEL, max_tokens=32768))
    assert info.value.body["error"]["type"] == "invalid_request_error"
    message = info.value.body["error"]["message"]
    assert message.startswith("input length and `max_tokens` exceed context limit: ")
    assert message.endswith(" + 32768 > 32768, decrease input length or `max_tokens` and "
                            "try again")


def test_a_prompt_over_the_context_in_each_api_s_words(
        engine_sidecar: tuple[str, MLXBackend]) -> None:
    engine_url = engine_sidecar[0]
    long = "word " * 33_000  # over the tiny model's 32,768
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client(engine_url).messages.create(
            model=TINY_MODEL, max_tokens=1, messages=[{"role": "user", "content": long}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 32768 maximum",
                        info.value.body["error"]["message"])
    sdk = openai_client(engine_url, "sk-acme")
    with pytest.raises(openai.BadRequestError) as oai:
        sdk.responses.create(model=TINY_MODEL, input=long)
    assert oai.value.code == "context_length_exceeded"
    assert "maximum context length is 32768 tokens" in oai.value.message
    with pytest.raises(openai.BadRequestError) as chat:
        sdk.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user",
                                                                 "content": long}])
    assert chat.value.code == "context_length_exceeded"


def test_codex_s_request_on_the_engine(engine_sidecar: tuple[str, MLXBackend]) -> None:
    engine_url = engine_sidecar[0]
    sdk = openai_client(engine_url, "sk-acme")
    fields = {**codex_fields(unique_system()["content"]), "model": TINY_MODEL,
              "stream": False, "max_output_tokens": 48,
              "tool_choice": {"type": "function", "name": "multi_agent.close_agent"}}
    raw = sdk.responses.with_raw_response.create(**sdk_fields(sdk.responses.create, fields))
    assert raw.headers["x-prefix-cache"] == "miss" and raw.headers[DROPPED] == "web_search"
    calls = [i for i in raw.parse().output if i.type == "function_call"]
    if calls:  # written under the grammar (a random model may run out of tokens first)
        assert (calls[0].name, calls[0].namespace) == ("close_agent", "multi_agent")


def test_a_request_without_a_limit_gets_the_model_s_default(
        engine_sidecar: tuple[str, MLXBackend]) -> None:
    """Codex and opencode's title requests name no limit: the engine's per-model default
    (``--engine-option default_max_tokens=N``, mlx_lm.server's 512 unless set), cut to the
    context left."""
    from engine_adapter.options import EngineOptions

    assert EngineOptions.parse({}).engine_kwargs()["default_max_tokens"] == 512
    options = EngineOptions.parse({"default_max_tokens": 7}).engine_kwargs()
    backend = MLXBackend(engine_sidecar[1].engine, default_max_tokens=options[
        "default_max_tokens"])
    checked = backend.check(BackendRequest(prompt_ids=[1, 2, 3]))
    assert checked.request.sampling.max_tokens == 7
    window = backend.context_length
    assert window is not None
    near_full = backend.check(BackendRequest(prompt_ids=[1] * (window - 3)))
    assert near_full.request.sampling.max_tokens == 3

"""Agents on the in-process engine (``serve --engine mlx``) with the real demo model
(SmolLM2-135M-Instruct) and real clients: structured outputs and forced tool calls hold by
constrained decoding (so on every run, not by luck), tool loops run turn after turn, and every
later turn is a static-prefix hit. One sidecar for the module; few tokens per turn."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("llguidance")
anthropic = pytest.importorskip("anthropic", reason="the Anthropic SDK is the client under test")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel, Field  # noqa: E402

from tests.support.server_thread import ServerThread  # noqa: E402
from tests.support.sidecar import engine_sidecar_app  # noqa: E402

MODEL = "smollm2-135m-instruct"
TIMEOUT_S = 300.0  # two shared cores: a turn of the demo model can take tens of seconds
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
           "required": ["city"], "additionalProperties": False}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "add_numbers", "description": "Add two integers",
                                      "parameters": ADD}},
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "The weather in a city",
                                      "parameters": WEATHER}},
]
SCHEMAS = {"add_numbers": ADD, "get_weather": WEATHER}
SYSTEM = "You are a helpful assistant with tools."
GREEDY = {"temperature": 0.0}  # (this Anthropic SDK takes no temperature argument)


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int


@pytest.fixture(scope="module")
def sidecar(demo_chat_dir: Path) -> Iterator[tuple[str, Any]]:
    app = engine_sidecar_app(demo_chat_dir, engine_options={"kv_disk_bytes": 0})
    engine = app.state.service.models.get(MODEL).engine
    with ServerThread(app) as url:
        yield url, engine


def openai_sdk(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-none", max_retries=0,
                         timeout=TIMEOUT_S)


def valid_call(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    """The call's arguments, checked against its tool's schema."""
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(parsed, SCHEMAS[name])
    return parsed


def test_chat_completions_parse_returns_the_pydantic_model(sidecar) -> None:
    url, _ = sidecar
    completion = openai_sdk(url).chat.completions.parse(
        model=MODEL, response_format=City, max_tokens=40, temperature=0.0,
        messages=[{"role": "user", "content": "Name a big city and its population."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    # Not strict: the schema still binds; and a schema the engine cannot compile is a 400.
    loose = openai_sdk(url).chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0.0,
        messages=[{"role": "user", "content": "Name a city."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "city", "schema": City.model_json_schema()}})
    City.model_validate_json(loose.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema"):
        openai_sdk(url).chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "string", "pattern": "(?=a)"}}})


def test_an_openai_tool_loop_of_three_turns(sidecar) -> None:
    url, engine = sidecar
    sdk = openai_sdk(url)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 2 plus 3?"}]
    caches = []
    for turn, choice in enumerate(["required",
                                   {"type": "function", "function": {"name": "get_weather"}},
                                   "auto"]):
        if turn == 1:
            messages.append({"role": "user", "content": "And the weather in Paris?"})
        raw = sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, tools=CHAT_TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=48, temperature=0.0)
        caches.append(raw.headers["x-prefix-cache"])
        message = raw.parse().choices[0].message
        if turn == 2:
            assert raw.parse().choices[0].finish_reason in ("stop", "tool_calls", "length")
            break
        assert raw.parse().choices[0].finish_reason == "tool_calls"
        (call,) = message.tool_calls
        assert call.function.name == ("add_numbers" if turn == 0 else "get_weather")
        arguments = valid_call(call.function.name, call.function.arguments)
        result = (arguments["a"] + arguments["b"]) if turn == 0 else "sunny, 21 C"
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
    assert caches[1:] == ["hit", "hit"]  # the system turn and the tools: the static prefix
    assert engine.snapshot_stats().reused_tokens > 0


def test_streamed_tool_calls_and_json(sidecar) -> None:
    url, _ = sidecar
    stream = openai_sdk(url).chat.completions.create(
        model=MODEL, tools=CHAT_TOOLS, tool_choice="required", max_tokens=48, temperature=0.0,
        stream=True, messages=[{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "Weather in Rome?"}])
    calls: dict[int, dict[str, str]] = {}
    finish, pieces = None, 0
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                pieces += bool(delta.function.arguments)
    assert finish == "tool_calls" and calls
    assert pieces > len(calls)  # the arguments came as they were generated, not in one piece
    for call in calls.values():
        valid_call(call["name"], call["arguments"])


def test_an_anthropic_tool_use_loop(sidecar) -> None:
    url, _ = sidecar
    sdk = anthropic.Anthropic(base_url=url, api_key="sk-none", max_retries=0, timeout=TIMEOUT_S)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 4 plus 5?"}]
    first = sdk.messages.with_raw_response.create(
        model=MODEL, system=SYSTEM, tools=tools, max_tokens=48, extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "add_numbers"}, messages=messages)
    message = first.parse()
    assert message.stop_reason == "tool_use"
    use = next(block for block in message.content if block.type == "tool_use")
    arguments = valid_call(use.name, use.input)
    messages += [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": str(arguments["a"] + arguments["b"])}]}]
    second = sdk.messages.with_raw_response.create(
        model=MODEL, system=SYSTEM, tools=tools, max_tokens=48, extra_body=GREEDY,
        tool_choice={"type": "any"}, messages=messages)
    assert second.headers["x-prefix-cache"] == "hit"
    again = second.parse()
    assert again.stop_reason == "tool_use" and again.usage.cache_read_input_tokens > 0
    for block in again.content:
        if block.type == "tool_use":
            valid_call(block.name, block.input)
    with pytest.raises(anthropic.BadRequestError, match=r"tools\[0\].input_schema"):
        sdk.messages.create(model=MODEL, max_tokens=4, tool_choice={"type": "any"},
                            messages=[{"role": "user", "content": "x"}],
                            tools=[{"name": "f", "input_schema": {
                                "type": "object", "properties": {"s": {
                                    "type": "string", "pattern": "(?<=a)"}}}}])


def test_a_responses_function_call_loop(sidecar) -> None:
    url, _ = sidecar
    sdk = openai_sdk(url)
    tools = [{"type": "function", "name": t["function"]["name"],
              "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": True} for t in CHAT_TOOLS]
    first = sdk.responses.with_raw_response.create(
        model=MODEL, instructions=SYSTEM, input="What is 6 plus 7?", tools=tools,
        tool_choice="required", parallel_tool_calls=False, max_output_tokens=48,
        temperature=0.0)
    response = first.parse()
    (call,) = [item for item in response.output if item.type == "function_call"]
    arguments = valid_call(call.name, call.arguments)
    result = arguments.get("a", 0) + arguments.get("b", 0) if call.name == "add_numbers" else "?"
    second = sdk.responses.with_raw_response.create(
        model=MODEL, instructions=SYSTEM, tools=tools, max_output_tokens=24, temperature=0.0,
        tool_choice="none",  # the tools stay in the prompt (its static prefix); an answer now
        input=[{"role": "user", "content": "What is 6 plus 7?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": str(result)}],
        text={"format": {"type": "json_schema", "name": "answer", "strict": True, "schema": {
            "type": "object", "properties": {"sum": {"type": "integer"}},
            "required": ["sum"], "additionalProperties": False}}})
    assert second.headers["x-prefix-cache"] == "hit"
    answer = second.parse()
    assert isinstance(json.loads(answer.output_text)["sum"], int)
    with pytest.raises(openai.BadRequestError, match="text.format.schema"):
        sdk.responses.create(model=MODEL, input="x", max_output_tokens=4, text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "string",
                                                           "pattern": "(?=a)"}}})


def test_an_openai_agents_agent_with_two_function_tools(sidecar) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is the framework under test")
    url, engine = sidecar
    seen: list[tuple[str, dict[str, Any]]] = []

    @agents.function_tool
    def add_numbers(a: int, b: int) -> int:
        """Add two integers."""
        seen.append(("add_numbers", {"a": a, "b": b}))
        return a + b

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(("get_weather", {"city": city}))
        return "sunny"

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-none", max_retries=0,
                                timeout=TIMEOUT_S)
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    agent = agents.Agent(
        name="calculator", instructions=SYSTEM, model=model, tools=[add_numbers, get_weather],
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0.0,
                                            max_tokens=48, parallel_tool_calls=False),
        reset_tool_choice=True)  # after a call, "auto": the run can end
    before = engine.snapshot_stats().reused_tokens
    result = agents.Runner.run_sync(agent, "What is 20 plus 22?", max_turns=3,
                                    run_config=agents.RunConfig(tracing_disabled=True))
    assert seen and seen[0][0] in ("add_numbers", "get_weather")
    for name, arguments in seen:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert isinstance(result.final_output, str)
    assert engine.snapshot_stats().reused_tokens > before  # the second turn restored the first

"""Model families' tool calls and reasoning through the three agent APIs on the engine, with
the real ``openai`` and ``anthropic`` SDKs: a call forced by a grammar on a tiny random-weights
Qwen3 or Llama 3.1 (real tokenizer, its own template, the call in its own format) comes back as
a tool call, whole and streamed, also where the tokenizer marks Qwen3's markers special; a
``<think>`` family's reasoning comes back apart from the answer (forced output, played back by a
scripted engine on Qwen3.5's tokenizer and template, whose generation prompt opens
``<think>``), Anthropic's and Responses' thinking switches set the template's, and reasoning
sent back renders where the template puts it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
anthropic = pytest.importorskip("anthropic", reason="the Anthropic SDK is the client under test")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

from engine_adapter.backend import MLXBackend  # noqa: E402
from engine_adapter.server import create_engine_app  # noqa: E402
from tests.support.loopback import anthropic_client, openai_client  # noqa: E402
from tests.support.paths import TEMPLATES_DIR, needs_templates  # noqa: E402
from tests.support.scripted_engine import ScriptedEngine  # noqa: E402
from tests.support.server_thread import ServerThread  # noqa: E402

SWITCH = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
          "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "set_alarm", "parameters": SWITCH}}
MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

pytestmark = needs_templates   # the real templates, from ../shared


def qwen3_folder(dest: Path, special_markers: bool) -> Path:
    """A tiny Qwen3 with the real tokenizer and Qwen3's template; ``special_markers``: its
    tokenizer marks the tool-call and think markers special (decoding would drop them)."""
    from engine_adapter.testing.tiny_model import tiny_model_folder

    template = (TEMPLATES_DIR / "Qwen-Qwen3-0.6B.jinja").read_text()
    folder = tiny_model_folder(dest, "qwen3", chat_template=template)
    if special_markers:
        data = json.loads((folder / "tokenizer.json").read_text())
        for token in data["added_tokens"]:
            token["special"] = token["special"] or token["content"] in MARKERS
        (folder / "tokenizer.json").write_text(json.dumps(data))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        for token in config.get("added_tokens_decoder", {}).values():
            token["special"] = token["special"] or token["content"] in MARKERS
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["qwen3", "qwen3-special-markers", "llama3.1"])
def forced_engine(request: pytest.FixtureRequest, engine_models_dir: Path) -> Iterator[str]:
    """serve-engine on a tiny model with its family's own tokenizer and template: Qwen3 (its
    calls between markers; also with the markers special), Llama 3.1 (a call is the bare JSON
    ``{"name", "parameters"}`` reply, one a turn)."""
    from engine_adapter.testing.tiny_model import tiny_model_folder

    if request.param == "llama3.1":
        template = (TEMPLATES_DIR / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
        folder = tiny_model_folder(engine_models_dir / "llama3.1-own-template", "llama",
                                   tokenizer="llama3.1", chat_template=template)
    else:
        special = request.param == "qwen3-special-markers"
        folder = qwen3_folder(engine_models_dir / f"qwen3-own-template-{special}", special)
    backend = MLXBackend.load(folder, name=request.param)
    assert backend.envelope is not None   # forced calls in the family's own format
    assert backend.envelope.bare == (request.param == "llama3.1")
    with ServerThread(create_engine_app(backend)) as url:
        yield url


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_is_a_tool_call_in_every_api(forced_engine: str, choice: str) -> None:
    sdk, claude = openai_client(forced_engine), anthropic_client(forced_engine)
    user = [{"role": "user", "content": "Wake me."}]
    chat_choice: Any = ("required" if choice == "required" else
                        {"type": "function", "function": {"name": "set_alarm"}})
    whole = sdk.chat.completions.create(model="m", messages=user, tools=[CHAT_TOOL],
                                        tool_choice=chat_choice, max_tokens=24,
                                        temperature=0.0)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and not message.content
    assert [(c.function.name, json.loads(c.function.arguments).keys())
            for c in message.tool_calls] == [("set_alarm", {"on"})]
    stream = sdk.chat.completions.create(model="m", messages=user, tools=[CHAT_TOOL],
                                         tool_choice=chat_choice, max_tokens=24,
                                         temperature=0.0, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    assert deltas[-1].finish_reason == "tool_calls"
    assert not "".join(d.delta.content or "" for d in deltas)
    calls = [t for d in deltas for t in d.delta.tool_calls or ()]
    assert [t.function.name for t in calls if t.function.name] == ["set_alarm"]
    assert json.loads("".join(t.function.arguments or "" for t in calls)).keys() == {"on"}

    tool = {"name": "set_alarm", "input_schema": SWITCH}
    tool_choice: Any = ({"type": "any"} if choice == "required" else
                        {"type": "tool", "name": "set_alarm"})
    greedy = {"temperature": 0.0}   # the SDK's own argument is gone: sent as a body field
    reply = claude.messages.create(model="m", max_tokens=24, tools=[tool],
                                   tool_choice=tool_choice, messages=user, extra_body=greedy)
    with claude.messages.stream(model="m", max_tokens=24, tools=[tool],
                                tool_choice=tool_choice, messages=user,
                                extra_body=greedy) as events:
        streamed = events.get_final_message()
    for message in (reply, streamed):
        assert message.stop_reason == "tool_use"
        assert [(b.type, b.name, set(b.input)) for b in message.content] == [
            ("tool_use", "set_alarm", {"on"})]

    function = {"type": "function", "name": "set_alarm", "parameters": SWITCH}
    forced: Any = ("required" if choice == "required" else
                   {"type": "function", "name": "set_alarm"})
    response = sdk.responses.create(model="m", input="Wake me.", tools=[function],
                                    tool_choice=forced, max_output_tokens=24, temperature=0.0)
    with sdk.responses.stream(model="m", input="Wake me.", tools=[function],
                              tool_choice=forced, max_output_tokens=24, temperature=0.0) as events:
        final = events.get_final_response()
    for answer in (response, final):
        assert [(i.type, i.name, set(json.loads(i.arguments))) for i in answer.output] == [
            ("function_call", "set_alarm", {"on"})]


# -- reasoning apart from the answer ----------------------------------------------------------


class Thinking:
    """serve-engine on a scripted engine with Qwen3.5's tokenizer and template (as mlx-lm loads
    them); ``play`` sets what the engine writes next, tokenized as the model would write it."""

    def __init__(self, url: str, engine: ScriptedEngine, tokenizer: Any, folder: Path) -> None:
        self.url, self.engine, self.tokenizer, self.folder = url, engine, tokenizer, folder

    def play(self, text: str) -> None:
        self.engine.tokens = (self.tokenizer.encode(text, add_special_tokens=False)
                              + list(self.engine.stop_token_ids))


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Thinking]:
    from mlx_lm.tokenizer_utils import load

    from prefix_cache.testing.offline_tokenizers import make_model_dir

    template = (TEMPLATES_DIR / "Qwen3.5-4B.jinja").read_text()
    folder = make_model_dir(tmp_path_factory.mktemp("qwen3.5"), "qwen3.5", template)
    tokenizer = load(folder)
    engine = ScriptedEngine([], stop_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),),
                            finish="stop")
    with ServerThread(create_engine_app(MLXBackend(engine, tokenizer, name="qwen3.5"))) as url:
        yield Thinking(url, engine, tokenizer, folder)


THOUGHT, ANSWER = "The user greets me.", "Hello there."
HI = [{"role": "user", "content": "Hi"}]


def test_reasoning_comes_apart_from_the_answer_in_chat_completions(thinking: Thinking) -> None:
    thinking.play(f"{THOUGHT}\n</think>\n\n{ANSWER}")  # the prompt opened <think>
    sdk = openai_client(thinking.url)
    message = sdk.chat.completions.create(model="m", messages=HI, max_tokens=40).choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == (ANSWER, THOUGHT)
    chunks = [c.choices[0].delta for c in sdk.chat.completions.create(
        model="m", messages=HI, max_tokens=40, stream=True) if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks)
    assert (reasoning, "".join(d.content or "" for d in chunks)) == (THOUGHT, ANSWER)
    # Thinking switched off: the template closes the block itself; all of it is the answer.
    thinking.play(ANSWER)
    off = sdk.chat.completions.create(model="m", messages=HI, max_tokens=40, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert off.content == ANSWER and "reasoning_content" not in (off.model_extra or {})


def test_reasoning_is_a_thinking_block_in_messages(thinking: Thinking) -> None:
    thinking.play(f"{THOUGHT}\n</think>\n\n{ANSWER}")
    claude = anthropic_client(thinking.url)
    # Claude Code's thinking setting is accepted; the template decides whether the model thinks.
    fields: Any = {"model": "m", "max_tokens": 40, "messages": HI,
                   "thinking": {"type": "enabled", "budget_tokens": 1024}}
    whole = claude.messages.create(**fields)
    with claude.messages.stream(**fields) as events:
        kinds = [e.type for e in events]
        streamed = events.get_final_message()
    assert "thinking" in kinds
    for message in (whole, streamed):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert (message.content[0].thinking, message.content[1].text) == (THOUGHT, ANSWER)
    # A cut-off turn is all reasoning.
    thinking.play(f"{THOUGHT} And")
    cut = claude.messages.create(**fields)
    assert [(b.type, b.thinking) for b in cut.content] == [("thinking", f"{THOUGHT} And")]


def test_reasoning_is_a_reasoning_item_in_responses(thinking: Thinking) -> None:
    thinking.play(f"{THOUGHT}\n</think>\n\n{ANSWER}")
    sdk = openai_client(thinking.url)
    fields: Any = {"model": "m", "input": "Hi", "max_output_tokens": 40,
                   "reasoning": {"effort": "low", "summary": "auto"},
                   "include": ["reasoning.encrypted_content"]}   # Codex's
    whole = sdk.responses.create(**fields)
    with sdk.responses.stream(**fields) as events:
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        streamed = events.get_final_response()
    assert "".join(deltas) == THOUGHT
    for response in (whole, streamed):
        assert [i.type for i in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == THOUGHT
        assert response.output_text == ANSWER


def test_reasoning_relayed_from_a_chat_only_upstream_keeps_its_shape(thinking: Thinking) -> None:
    """A sidecar in front of the engine as a chat-completions upstream: the upstream's
    ``reasoning_content`` becomes the Messages thinking block, streamed and whole."""
    from prefix_cache.model_folders.model_dir import load_tokenizer
    from prefix_cache.service.upstream import Upstream
    from tests.support.sidecar import TENANT_KEYS, served, sidecar_app

    thinking.play(f"{THOUGHT}\n</think>\n\n{ANSWER}")
    upstream = Upstream(thinking.url, "openai")
    app = sidecar_app(served("q", load_tokenizer(thinking.folder), upstream),
                      api_keys=TENANT_KEYS)
    with ServerThread(app) as url:
        claude = anthropic_client(url)
        fields: Any = {"model": "q", "max_tokens": 40, "messages": HI}
        whole = claude.messages.create(**fields)
        with claude.messages.stream(**fields) as events:
            streamed = events.get_final_message()
    for message in (whole, streamed):
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                for b in message.content] == [("thinking", THOUGHT), ("text", ANSWER)]


# -- the template's thinking switch, and reasoning sent back -----------------------------------


def test_thinking_switches_map_to_the_templates_enable_thinking(thinking: Thinking) -> None:
    """Anthropic ``thinking`` and Responses' ``reasoning.effort`` set Qwen3.5's
    ``enable_thinking``: off, the template closes the block and all the output is answer."""
    claude, sdk = anthropic_client(thinking.url), openai_client(thinking.url)
    thinking.play(ANSWER)
    off = claude.messages.create(model="m", max_tokens=40, messages=HI,
                                 thinking={"type": "disabled"})
    assert [(b.type, getattr(b, "text", None)) for b in off.content] == [("text", ANSWER)]
    quick = sdk.responses.create(model="m", input="Hi", max_output_tokens=40,
                                 reasoning={"effort": "minimal"})
    assert [i.type for i in quick.output] == ["message"] and quick.output_text == ANSWER
    thinking.play(f"{THOUGHT}\n</think>\n\n{ANSWER}")
    for kind in ("enabled", "adaptive"):
        on = claude.messages.create(model="m", max_tokens=40, messages=HI,
                                    thinking={"type": kind, "budget_tokens": 1024})
        assert [b.type for b in on.content] == ["thinking", "text"]
    deep = sdk.responses.create(model="m", input="Hi", max_output_tokens=40,
                                reasoning={"effort": "high"})
    assert [i.type for i in deep.output] == ["reasoning", "message"]
    with pytest.raises(anthropic.BadRequestError, match="thinking.type"):
        claude.messages.create(model="m", max_tokens=40, messages=HI,
                               thinking={"type": "sometimes"})  # type: ignore[arg-type]


def test_a_switch_the_template_does_not_read_is_not_sent(thinking: Thinking) -> None:
    # Rendered and cached as if absent: the cache key holds the kwargs.
    from prefix_cache.chat.conversation import Conversation, for_template

    llama = (TEMPLATES_DIR / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    switches = {"enable_thinking": False, "reasoning_effort": "low"}
    plain = for_template(Conversation(HI, chat_template=llama, template_switches=switches),
                         thinking.tokenizer)
    assert plain.chat_template_kwargs is None and plain.template_switches is None
    qwen = for_template(Conversation(HI, None, {"enable_thinking": True},
                                     template_switches=switches), thinking.tokenizer)
    assert qwen.chat_template_kwargs == {"enable_thinking": True}   # the client's own wins


def test_reasoning_sent_back_renders_where_the_template_puts_it(thinking: Thinking) -> None:
    """A tool loop's earlier reasoning (Anthropic thinking blocks, a Responses reasoning item)
    is the assistant turn's ``reasoning_content``: Qwen3.5's template renders it inside the
    loop, as the model wrote it."""
    from engine_adapter.engine_host import render_conversation
    from prefix_cache.chat.anthropic_params import messages_conversation
    from prefix_cache.chat.responses_params import parse_responses_body

    call = {"type": "tool_use", "id": "c1", "name": "clock", "input": {}}
    body = {"messages": HI + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT,
                                           "signature": "s"}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                      "content": "7:00"}]}]}
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "summary": [], "content": [
                 {"type": "reasoning_text", "text": THOUGHT}]},
             {"type": "function_call", "call_id": "c1", "name": "clock", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "7:00"}]
    responses = parse_responses_body({"model": "m", "input": items},
                                     lambda _: None).call.conversation
    for conversation in (messages_conversation(body), responses):
        assistant = conversation.messages[1]
        assert assistant["reasoning_content"] == THOUGHT and assistant["tool_calls"]
        prompt = thinking.tokenizer.decode(render_conversation(thinking.tokenizer,
                                                               conversation))
        assert f"<think>\n{THOUGHT}\n</think>" in prompt


def test_reasoning_sent_back_keeps_the_next_prompt_on_the_turns_tokens(thinking: Thinking) -> None:
    """Conversation KV reuse serves what the next prompt shares with the last turn's prompt and
    reply. In a tool loop on Qwen3.5, the turn as the model wrote it (reasoning, then the call)
    is the start of the next prompt when its reasoning is sent back: all of it is reusable;
    dropped, the next prompt parts from it before the reply (here: 267 tokens shared against
    243, of a 244-token prompt and a 23-token reply)."""
    from engine_adapter.engine_host import render_conversation
    from prefix_cache.chat.anthropic_params import messages_conversation

    tools = [{"name": "clock", "description": "Time.", "input_schema": {"type": "object"}}]
    call = {"type": "tool_use", "id": "c1", "name": "clock", "input": {}}
    thought = {"type": "thinking", "thinking": THOUGHT, "signature": ""}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                           "content": "7:00"}]}

    def prompt(*assistant: dict[str, Any]) -> list[int]:
        turns = HI + ([{"role": "assistant", "content": list(assistant)}, result]
                      if assistant else [])
        return render_conversation(thinking.tokenizer, messages_conversation(
            {"messages": turns, "tools": tools}))

    first, kept, dropped = prompt(), prompt(thought, call), prompt(call)
    end = kept.index(thinking.tokenizer.convert_tokens_to_ids("<|im_end|>"), len(first)) + 1
    written = kept[:end]   # turn 1's prompt and the reply the template shows it wrote
    assert written[:len(first)] == first

    def shared(ids: list[int]) -> int:
        return next((i for i, (a, b) in enumerate(zip(ids, written)) if a != b), len(written))

    assert shared(kept) == len(written)
    assert shared(dropped) < len(first)

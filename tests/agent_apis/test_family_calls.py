"""Every family of ``engine_adapter.families.FAMILIES``: tool calls rendered by the family's own
template (an assistant turn with two calls, one where the template allows only one) and played
back as the engine's output token for token, on the family's real tokenizer, come back as the
same calls in all three APIs, whole and streamed, with a sentence written before them kept as
text (what ``auto`` allows). A scripted engine plays the text: random weights cannot write a
family's format. The registry's claims (each family's call format, its reasoning markers) are
checked against what the engine reads off the tokenizer and template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("anthropic", reason="the Anthropic SDK is the client under test")
pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

from engine_adapter.backend import MLXBackend  # noqa: E402
from engine_adapter.families import FAMILIES, Family, call_format  # noqa: E402
from engine_adapter.reasoning import think_markers  # noqa: E402
from engine_adapter.server import create_engine_app  # noqa: E402
from tests.support.loopback import anthropic_client, openai_client  # noqa: E402
from tests.support.paths import TEMPLATES_DIR, needs_templates  # noqa: E402
from tests.support.scripted_engine import ScriptedEngine  # noqa: E402
from tests.support.server_thread import ServerThread  # noqa: E402

pytestmark = needs_templates   # the real templates, from ../shared

SCHEMA = {"type": "object", "properties": {"on": {"type": "boolean"}, "at": {"type": "string"}},
          "required": ["on"]}
CHAT_TOOL = {"type": "function", "function": {"name": "set_alarm", "description": "An alarm.",
                                              "parameters": SCHEMA}}
# Mistral's templates want 9-character alphanumeric ids.
CALLS = [("abcDEF123", {"on": True, "at": "7:00"}), ("xyzUVW456", {"on": False})]
SENTENCE = "Let me set it."
USER = [{"role": "user", "content": "Wake me at seven."}]


@dataclass
class Served:
    family: Family
    url: str
    expected: list[tuple[str, dict[str, Any]]]   # (name, arguments) of each call


def generated_turn(tokenizer: Any, family: Family) -> tuple[str, int]:
    """The assistant turn with the calls as the template renders it, cut where the model's
    turn ends, and how many calls it holds."""
    calls = CALLS if family.parallel else CALLS[:1]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "set_alarm", "arguments": a}}
        for i, a in calls]}
    kwargs: dict[str, Any] = {"tokenize": False, "tools": [CHAT_TOOL]}
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, **kwargs)
    whole = tokenizer.apply_chat_template(USER + [turn], **kwargs)
    assert whole.startswith(prompt), family.name
    text = whole[len(prompt):]
    end = text.index(family.end_of_turn) if family.end_of_turn else len(text)
    return text[:end], len(calls)


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f.calls],
                ids=lambda f: f.template)
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from mlx_lm.tokenizer_utils import load

    from prefix_cache.testing.offline_tokenizers import make_model_dir

    family: Family = request.param
    template = (TEMPLATES_DIR / f"{family.template}.jinja").read_text()
    folder = make_model_dir(tmp_path_factory.mktemp("family"), family.tokenizer, template)
    tokenizer = load(Path(folder))
    fmt = call_format(tokenizer)
    # The registry says what the engine reads off this tokenizer and template.
    assert fmt is not None and fmt.name == family.calls
    markers = think_markers(tokenizer)
    assert (markers.start if markers else None) == family.reasoning
    text, n = generated_turn(tokenizer, family)
    text = text.replace(fmt.start, f"{SENTENCE}\n{fmt.start}", 1)   # text, then the calls
    stops = tuple(getattr(tokenizer, "eos_token_ids", ()) or (tokenizer.eos_token_id,))
    engine = ScriptedEngine(tokenizer.encode(text, add_special_tokens=False) + [min(stops)],
                            stop_token_ids=stops, finish="stop")
    backend = MLXBackend(engine, tokenizer, name=family.template)
    with ServerThread(create_engine_app(backend)) as url:
        yield Served(family, url, [("set_alarm", a) for _, a in CALLS[:n]])


def test_the_registry_names_a_format_only_where_one_is_read(tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load

    from prefix_cache.testing.offline_tokenizers import make_model_dir

    for family in (f for f in FAMILIES if not f.calls):   # gpt-oss's harmony: not read yet
        template = (TEMPLATES_DIR / f"{family.template}.jinja").read_text()
        tokenizer = load(Path(make_model_dir(tmp_path / family.tokenizer, family.tokenizer,
                                             template)))
        assert call_format(tokenizer) is None, family.name


def test_chat_completions_round_trip(served: Served) -> None:
    sdk = openai_client(served.url)
    fields: Any = {"model": "m", "messages": USER, "tools": [CHAT_TOOL], "max_tokens": 200}
    whole = sdk.chat.completions.create(**fields).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert (whole.message.content or "").strip() == SENTENCE
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in whole.message.tool_calls or ()] == served.expected
    assert len({c.id for c in whole.message.tool_calls or ()}) == len(served.expected)
    chunks = [c.choices[0] for c in sdk.chat.completions.create(**fields, stream=True)
              if c.choices]
    assert chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.delta.content or "" for c in chunks).strip() == SENTENCE
    calls: dict[int, list[str]] = {}
    for delta in (t for c in chunks for t in c.delta.tool_calls or ()):
        name, args = calls.setdefault(delta.index, ["", ""])
        calls[delta.index] = [name + (delta.function.name or ""),
                              args + (delta.function.arguments or "")]
    assert [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())] == served.expected


def test_messages_round_trip(served: Served) -> None:
    claude = anthropic_client(served.url)
    fields: Any = {"model": "m", "max_tokens": 200, "messages": USER,
                   "tools": [{"name": "set_alarm", "description": "An alarm.",
                              "input_schema": SCHEMA}]}
    whole = claude.messages.create(**fields)
    with claude.messages.stream(**fields) as events:
        streamed = events.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        assert [b.type for b in message.content] == ["text"] + ["tool_use"] * len(
            served.expected)
        assert message.content[0].text.strip() == SENTENCE
        assert [(b.name, b.input) for b in message.content[1:]] == served.expected


def test_responses_round_trip(served: Served) -> None:
    sdk = openai_client(served.url)
    fields: Any = {"model": "m", "input": USER[0]["content"], "max_output_tokens": 200,
                   "tools": [{"type": "function", "name": "set_alarm",
                         "description": "An alarm.", "parameters": SCHEMA}]}
    whole = sdk.responses.create(**fields)
    with sdk.responses.stream(**fields) as events:
        streamed = events.get_final_response()
    for response in (whole, streamed):
        assert response.output_text.strip() == SENTENCE
        assert [(i.name, json.loads(i.arguments)) for i in response.output
                if i.type == "function_call"] == served.expected

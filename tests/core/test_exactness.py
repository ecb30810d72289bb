"""Exactness: the boundary is the two-probe answer for the render the engine really does, never
past the first non-static text, and keys follow everything the template sees (issue #11).

One test (or one group) per way the answer used to go wrong, each with real tokenizers and
templates that model the real family, checked against the independent references.
"""

from __future__ import annotations

import copy
import enum
import json
from datetime import date, datetime
from typing import Any

import pytest

from prefix_cache import InvalidRequestError, MemoryStore, StaticPrefixCache, TemplateRenderError

from tests.support import reference
from tests.support.templates import (
    BEFORE_LAST_USER,
    DEFAULT_SYSTEM,
    FAILS_ON_NONE_WHEN_STRICT,
    THINKING,
    TODAYS_DATE,
    TOOLS_NOT_NONE,
)
from tests.support.tokenizers import fresh
from tests.support.tools import make_tools

SYSTEM = {"role": "system", "content": "You are the release agent. Please keep the changelog."}


def conv(*users: str) -> list[dict[str, Any]]:
    """The system message, then user turns with an assistant answer between them."""
    out: list[dict[str, Any]] = [SYSTEM]
    for i, text in enumerate(users):
        if i:
            out.append({"role": "assistant", "content": "Done."})
        out.append({"role": "user", "content": text})
    return out


# -- 1. tools=[] stays [] -------------------------------------------------------------------------


def test_empty_tools_render_as_given(qwen3) -> None:
    """An engine that renders with tools=[] gets the two-probe answer over that render."""
    messages = conv("Ship it.")
    engine_ids = reference.render(qwen3, messages, [], None, TOOLS_NOT_NONE)
    cache = StaticPrefixCache()
    r = cache.resolve(qwen3, messages, [], prompt_ids=engine_ids, chat_template=TOOLS_NOT_NONE)
    expected = reference.two_probe(qwen3, messages, [], template=TOOLS_NOT_NONE)
    assert r.specprefill_system_end == expected
    assert expected > reference.two_probe(qwen3, messages, None, template=TOOLS_NOT_NONE)
    # Rendered here too, [] is what renders, and it keys apart from None.
    mine = cache.resolve(qwen3, messages, [], chat_template=TOOLS_NOT_NONE)
    assert mine.prompt_ids == engine_ids and mine.hit
    none = cache.resolve(qwen3, messages, None, chat_template=TOOLS_NOT_NONE)
    assert none.key != r.key and none.cache == "miss"


def test_empty_tools_pick_the_tool_use_template(qwen3) -> None:
    """transformers picks a tokenizer's ``tool_use`` template whenever tools is not None."""
    tok = copy.copy(qwen3)
    tok.chat_template = {"default": DEFAULT_SYSTEM, "tool_use": TOOLS_NOT_NONE}
    messages = conv("Ship it.")
    engine_ids = reference.render(tok, messages, [], None, None)
    r = StaticPrefixCache().resolve(tok, messages, [], prompt_ids=engine_ids)
    assert r.specprefill_system_end == reference.two_probe(tok, messages, [])
    assert "Environment: ipython" in tok.decode(engine_ids[: r.specprefill_system_end])


# -- 2. an mlx-lm TokenizerWrapper renders with what it injects -------------------------------------


def test_wrapper_renders_with_its_own_method(qwen3) -> None:
    tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")
    wrapper = tokenizer_utils.TokenizerWrapper(qwen3)
    assert wrapper.has_thinking  # Qwen3's vocabulary: the wrapper sets enable_thinking=True
    messages = conv("Ship it.")
    engine_ids = reference.render(wrapper, messages, None, None, THINKING)
    cache = StaticPrefixCache()
    r = cache.resolve(wrapper, messages, prompt_ids=engine_ids, chat_template=THINKING)
    assert r.specprefill_system_end == reference.two_probe(wrapper, messages, template=THINKING)
    assert "Think step by step" in qwen3.decode(engine_ids[: r.specprefill_system_end])
    # Rendered here, the prompt is the wrapper's; the bare tokenizer renders (and keys) apart.
    assert cache.resolve(wrapper, messages, chat_template=THINKING).prompt_ids == engine_ids
    bare = cache.resolve(qwen3, messages, chat_template=THINKING)
    assert bare.key != r.key and bare.cache == "miss"
    assert bare.specprefill_system_end == reference.two_probe(qwen3, messages, template=THINKING)


def test_wrapper_with_a_python_renderer() -> None:
    """mlx-lm's chat_template_type: a Python function renders instead of the Jinja template."""
    tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")
    deepseek_v32 = pytest.importorskip("mlx_lm.chat_templates.deepseek_v32")
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    wrapper = tokenizer_utils.TokenizerWrapper(
        load_offline_tokenizer("deepseek"), chat_template=deepseek_v32.apply_chat_template)
    messages = conv("Ship it.")
    engine_ids = reference.render(wrapper, messages, None, None, None)
    r = StaticPrefixCache().resolve(wrapper, messages, prompt_ids=engine_ids)
    expected = reference.two_probe(wrapper, messages)
    assert r.specprefill_system_end == expected > 0
    with pytest.raises(InvalidRequestError, match="Python chat template"):
        StaticPrefixCache().resolve(wrapper, messages, chat_template=THINKING)


# -- 3. never past the first non-static text ------------------------------------------------------


@pytest.mark.parametrize("first", [
    "You are right, release it now.",   # starts like the system text
    "Please release it now.",           # starts like the system text, another word
    "Hi, release it now.",              # starts like a probe
    "Tell me a joke.",                  # is a probe
])
def test_moved_system_text_never_extends_into_user_text(qwen3, first: str) -> None:
    """Mistral's templates put the system text before the LAST user turn: in a multi-turn
    prompt the first user text sits where the probes have the system text."""
    system = {"role": "system", "content": first.split(",")[0].split(" ")[0] + " are the agent."}
    messages = [system, *conv(first, "And the notes?")[1:]]
    prompt = reference.render(qwen3, messages, None, None, BEFORE_LAST_USER)
    user_at = reference.first_user_text_index(qwen3, messages, template=BEFORE_LAST_USER)
    cache = StaticPrefixCache()
    miss = cache.resolve(qwen3, messages, prompt_ids=prompt, chat_template=BEFORE_LAST_USER)
    hit = cache.resolve(qwen3, messages, prompt_ids=prompt, chat_template=BEFORE_LAST_USER)
    expected = reference.exact(qwen3, messages, template=BEFORE_LAST_USER)
    assert miss.specprefill_system_end == hit.specprefill_system_end == expected <= user_at
    assert hit.hit
    # One turn is the probes' own layout: the full two-probe answer, system text included.
    single = [system, {"role": "user", "content": first}]
    one = cache.resolve(qwen3, single, chat_template=BEFORE_LAST_USER)
    assert one.specprefill_system_end == reference.two_probe(qwen3, single, template=BEFORE_LAST_USER)
    assert one.specprefill_system_end > expected


@pytest.mark.parametrize("give_ids", [True, False])
async def test_moved_system_text_through_aresolve(qwen3, give_ids: bool) -> None:
    messages = [{"role": "system", "content": "You are the agent."},
                *conv("You are right, release it now.", "And the notes?")[1:]]
    prompt = reference.render(qwen3, messages, None, None, BEFORE_LAST_USER)
    cache = StaticPrefixCache()
    for _ in range(2):
        r = await cache.aresolve(qwen3, messages, prompt_ids=prompt if give_ids else None,
                                 chat_template=BEFORE_LAST_USER)
        assert r.specprefill_system_end == reference.exact(qwen3, messages, template=BEFORE_LAST_USER)
        assert r.prompt_ids == prompt
    assert r.hit and cache.stats.snapshot()["cap_renders"] == 2


def test_moved_system_text_with_the_system_word_is_the_old_overreach(qwen3) -> None:
    """Guards the test above: the plain two-probe cut does pass into the user text there."""
    messages = [{"role": "system", "content": "You are the agent."},
                *conv("You are right, release it now.", "And the notes?")[1:]]
    user_at = reference.first_user_text_index(qwen3, messages, template=BEFORE_LAST_USER)
    assert reference.two_probe(qwen3, messages, template=BEFORE_LAST_USER) > user_at


def test_common_templates_pay_nothing_for_the_cap(qwen3, monkeypatch) -> None:
    """On a template whose static text comes first, a multi-turn hit renders nothing."""
    cache = StaticPrefixCache()
    messages = conv("You are right.", "Release it.")
    prompt = reference.render(qwen3, messages, None, None, DEFAULT_SYSTEM)
    cache.resolve(qwen3, messages, prompt_ids=prompt, chat_template=DEFAULT_SYSTEM)
    calls: list[int] = []
    original = qwen3.apply_chat_template
    monkeypatch.setitem(qwen3.__dict__, "apply_chat_template",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    r = cache.resolve(qwen3, messages, prompt_ids=prompt, chat_template=DEFAULT_SYSTEM)
    assert r.hit and calls == [] and cache.stats.snapshot()["cap_renders"] == 0
    assert r.specprefill_system_end == reference.exact(qwen3, messages, template=DEFAULT_SYSTEM)


# -- 4. key material is the plain data the template sees -------------------------------------------


class Effort(enum.Enum):
    HIGH = "high"


class StrEffort(enum.StrEnum):
    HIGH = "high"


@pytest.mark.parametrize("where,value", [
    ("kwargs", date(2026, 12, 2)),
    ("kwargs", datetime(2026, 12, 2, 9, 0)),
    ("kwargs", Effort.HIGH),
    ("kwargs", StrEffort.HIGH),
    ("kwargs", ("a", "b")),
    ("tools", ("path",)),
    ("system", {"a", "b"}),
])
def test_non_json_key_material_is_refused(qwen3, where: str, value: Any) -> None:
    """orjson would key these as the JSON they serialize to; the template sees something else
    (``<date>``, ``('a', 'b')``, the enum member), so two renders would share a key."""
    tools = make_tools(1)
    kwargs: dict[str, Any] = {}
    system = dict(SYSTEM)
    if where == "kwargs":
        kwargs["date_string"] = value
    elif where == "tools":
        tools[0]["function"]["parameters"]["required"] = value
    else:
        system["metadata"] = value
    cache = StaticPrefixCache()
    with pytest.raises(InvalidRequestError, match="not plain JSON data"):
        cache.resolve(qwen3, [system, {"role": "user", "content": "Go."}], tools, kwargs,
                      chat_template=TODAYS_DATE)
    assert len(cache.store) == 0


def test_big_integers_key_exactly(qwen3) -> None:
    """A template renders 2**70 digit for digit; it must neither fail nor share a float's key."""
    def with_default(value: Any) -> list[dict[str, Any]]:
        tools = make_tools(2)
        tools[0]["function"]["parameters"]["properties"]["limit"]["default"] = value
        return tools

    cache = StaticPrefixCache()
    messages = conv("Ship it.")
    big = cache.resolve(qwen3, messages, with_default(2**70), chat_template=DEFAULT_SYSTEM)
    near = cache.resolve(qwen3, messages, with_default(2**70 + 1), chat_template=DEFAULT_SYSTEM)
    as_float = cache.resolve(qwen3, messages, with_default(float(2**70)), chat_template=DEFAULT_SYSTEM)
    assert len({big.key, near.key, as_float.key}) == 3
    assert big.specprefill_system_end == reference.two_probe(
        qwen3, messages, with_default(2**70), template=DEFAULT_SYSTEM)
    assert cache.resolve(qwen3, messages, with_default(2**70), chat_template=DEFAULT_SYSTEM).hit


def test_cli_keeps_big_integers(qwen3, tmp_path, capsysbinary) -> None:
    from prefix_cache import cli
    from prefix_cache.testing.offline_tokenizers import make_model_dir

    folder = make_model_dir(tmp_path / "m", "qwen3", DEFAULT_SYSTEM)
    tool = make_tools(1)[0]
    lines = []
    for default in ("1180591620717411303424", "1180591620717411303425", "1.1805916207174113e21"):
        text = json.dumps({"messages": conv("Go."), "tools": [tool]})
        lines.append(text.replace('"default": 20', f'"default": {default}'))
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert cli.main(["boundary", "--model", str(folder), "--requests", str(path)]) == 0
    out = [json.loads(line) for line in capsysbinary.readouterr().out.decode().splitlines()]
    assert [o["cache"] for o in out] == ["miss", "miss", "miss"]
    assert len({o["key"] for o in out}) == 3
    assert out[0]["prompt_tokens"] == len(reference.render(
        qwen3, conv("Go."), [json.loads(lines[0])["tools"][0]], None, DEFAULT_SYSTEM))
    assert json.loads(lines[0])["tools"][0]["function"]["parameters"]["properties"]["limit"][
        "default"] == 2**70


# -- 5. the tokenizer's state is in the key --------------------------------------------------------


def test_tokens_added_after_first_use_change_the_key(qwen3) -> None:
    tok = fresh(qwen3)
    messages = [{"role": "system", "content": "Call <|deploy|> to ship."}, {"role": "user", "content": "Go."}]
    cache = StaticPrefixCache()
    before = cache.resolve(tok, messages, chat_template=DEFAULT_SYSTEM)
    tok.add_tokens(["<|deploy|>"])
    after = cache.resolve(tok, messages, chat_template=DEFAULT_SYSTEM)
    assert after.key != before.key and after.cache == "miss"
    assert after.specprefill_system_end == reference.two_probe(tok, messages, template=DEFAULT_SYSTEM)
    assert len(after.prompt_ids) < len(before.prompt_ids)


def test_split_special_tokens_is_in_the_key(qwen3) -> None:
    from transformers import AutoTokenizer

    split = AutoTokenizer.from_pretrained(qwen3.name_or_path, local_files_only=True,
                                          split_special_tokens=True)
    messages = conv("Ship it.")
    store = MemoryStore()  # shared, as replicas share Redis
    normal = StaticPrefixCache(store).resolve(qwen3, messages, chat_template=DEFAULT_SYSTEM)
    other = StaticPrefixCache(store).resolve(split, messages, chat_template=DEFAULT_SYSTEM)
    assert other.key != normal.key and other.cache == "miss"
    assert other.specprefill_system_end == reference.two_probe(split, messages, template=DEFAULT_SYSTEM)


# -- 6. the tools fallback is decided by the key's inputs, never learned -----------------------------


def test_tools_fallback_is_not_learned(qwen3) -> None:
    """Two replicas (tokenizer objects) share a store; one of them has seen a request whose
    template needed the [] fallback. Neither may serve the other a scaffold of another render."""
    store = MemoryStore()
    replica_a, replica_b = copy.copy(qwen3), copy.copy(qwen3)
    cache_a, cache_b = StaticPrefixCache(store), StaticPrefixCache(store)
    messages = conv("Ship it.")
    strict = cache_a.resolve(replica_a, messages, None, {"strict": True},
                             chat_template=FAILS_ON_NONE_WHEN_STRICT)
    assert strict.specprefill_system_end == reference.two_probe(
        replica_a, messages, None, {"strict": True}, template=FAILS_ON_NONE_WHEN_STRICT)
    first = cache_a.resolve(replica_a, messages, chat_template=FAILS_ON_NONE_WHEN_STRICT)
    engine_ids = reference.render(replica_b, messages, None, None, FAILS_ON_NONE_WHEN_STRICT)
    second = cache_b.resolve(replica_b, messages, prompt_ids=engine_ids,
                             chat_template=FAILS_ON_NONE_WHEN_STRICT)
    expected = reference.two_probe(replica_b, messages, template=FAILS_ON_NONE_WHEN_STRICT)
    assert first.prompt_ids == engine_ids
    assert first.specprefill_system_end == second.specprefill_system_end == expected
    assert second.hit


def test_prompt_and_probes_that_need_different_tools_are_refused(qwen3) -> None:
    """One render of a request never mixes tools=None and tools=[]: when its prompt renders
    only with [] but its probes only with None, the request is refused, not guessed."""
    template = ("{%- if messages[-1].content == 'List the tools.' %}{%- for t in tools %}{%- endfor %}"
                "{%- endif %}" + TOOLS_NOT_NONE)
    cache = StaticPrefixCache()
    with pytest.raises(TemplateRenderError, match="pass tools explicitly"):
        cache.resolve(qwen3, conv("List the tools."), chat_template=template)
    explicit = cache.resolve(qwen3, conv("List the tools."), [], chat_template=template)
    assert explicit.specprefill_system_end == reference.two_probe(
        qwen3, conv("List the tools."), [], template=template)


# -- 7. midnight --------------------------------------------------------------------------------------


def test_probes_that_cross_midnight_store_nothing(qwen3, monkeypatch) -> None:
    import transformers.utils.chat_template_utils as ctu

    import prefix_cache.render._template_clock as render  # where the key reads the clock

    clock = {"day": 2}

    class Frozen(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime:  # noqa: ARG003
            return datetime(2026, 12, clock["day"], 23, 59, 59)

    for module in (ctu, render):
        monkeypatch.setattr(module, "datetime", Frozen)
    original = qwen3.apply_chat_template

    def midnight_strikes(*args: Any, **kwargs: Any) -> Any:
        clock["day"] = 3  # the first probe render already sees tomorrow
        return original(*args, **kwargs)

    messages = conv("Ship it.")
    cache = StaticPrefixCache()
    with monkeypatch.context() as m:
        m.setitem(qwen3.__dict__, "apply_chat_template", midnight_strikes)
        crossed = cache.resolve(qwen3, messages, chat_template=TODAYS_DATE)
    assert len(cache.store) == 0  # its key says the 2nd; the probes saw the 3rd
    assert crossed.specprefill_system_end == reference.two_probe(qwen3, messages, template=TODAYS_DATE)
    clock["day"] = 2  # a replica still on the 2nd
    today = cache.resolve(qwen3, messages, chat_template=TODAYS_DATE)
    assert today.cache == "miss" and today.key == crossed.key
    assert today.specprefill_system_end == reference.two_probe(qwen3, messages, template=TODAYS_DATE)
    assert "02 Dec 2026" in qwen3.decode(today.prompt_ids[: today.specprefill_system_end])


# -- 8. prompt ids are checked before anything is stored ---------------------------------------------


@pytest.mark.parametrize("bad", [[1.5, 2], [-1, 2], [2**32, 2], ["1", 2], [None], "1 2 3", {1: 2}])
def test_bad_prompt_ids_are_refused_on_a_miss_and_a_hit(qwen3, bad: Any) -> None:
    cache = StaticPrefixCache()
    messages = conv("Ship it.")
    with pytest.raises(InvalidRequestError, match="prompt_ids"):
        cache.resolve(qwen3, messages, prompt_ids=bad, chat_template=DEFAULT_SYSTEM)
    assert len(cache.store) == 0
    cache.resolve(qwen3, messages, chat_template=DEFAULT_SYSTEM)
    with pytest.raises(InvalidRequestError, match="prompt_ids"):
        cache.resolve(qwen3, messages, prompt_ids=bad, chat_template=DEFAULT_SYSTEM)


async def test_bad_prompt_ids_are_refused_by_aresolve(qwen3) -> None:
    with pytest.raises(InvalidRequestError, match=r"prompt_ids\[1\]"):
        await StaticPrefixCache().aresolve(qwen3, conv("Go."), prompt_ids=[1, 2.0],
                                           chat_template=DEFAULT_SYSTEM)


def test_validate_token_ids() -> None:
    from prefix_cache.util.token_ids import validate_token_ids

    assert validate_token_ids([0, 5, 2**32 - 1]) == [0, 5, 2**32 - 1]
    assert validate_token_ids((3, 4)) == [3, 4]
    with pytest.raises(InvalidRequestError, match=r"prompt_token_ids\[2\] is 4294967296"):
        validate_token_ids([1, 2, 2**32], "prompt_token_ids")
    with pytest.raises(InvalidRequestError, match="must be a list"):
        validate_token_ids(b"\x01\x02")

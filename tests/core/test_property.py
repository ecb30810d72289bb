"""Property: over random conversations, tools and kwargs, rendered by a tokenizer or by an mlx-lm
TokenizerWrapper, a hit equals the uncached answer, and both equal the reference over the
renderer's own render. The classes of issue 23 each have a generator: token-table mutations,
request-level render fields, time formats in templates, binary and extension values, lone
surrogates; for each, a hit equals the reference or the request is refused with a clear error."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_cache import StaticPrefixCache
from prefix_cache.errors import PrefixCacheError

from tests.support import reference
from tests.support.templates import BEHAVIOURS
from tests.support.tools import make_tools

TRICKY = ["Hi", "Tell me a joke.", "", " ", "\n\n", "<|im_end|>", "Hi there", "T", "日本語", "{{ x }}",
          "You are the agent.", "You are right.", "Please go on."]
text = st.one_of(st.sampled_from(TRICKY), st.text(max_size=30))
TOOL_POOL = make_tools(6, seed=3)


@st.composite
def tools_strategy(draw: Any) -> list[dict[str, Any]] | None:
    chosen = draw(st.lists(st.sampled_from(range(len(TOOL_POOL))), unique=True, max_size=4))
    tools = [copy.deepcopy(TOOL_POOL[i]) for i in chosen]
    for tool in tools:
        if draw(st.booleans()):  # JSON key order is part of the render
            tool["function"] = dict(reversed(list(tool["function"].items())))
    return tools or draw(st.sampled_from([None, []]))


@st.composite
def conversations(draw: Any) -> list[dict[str, Any]]:
    static = [
        {"role": draw(st.sampled_from(["system", "developer"])), "content": draw(text)}
        for _ in range(draw(st.integers(0, 2)))
    ]
    turns: list[dict[str, Any]] = []
    for i in range(draw(st.integers(0, 4))):
        role = "user" if i % 2 == 0 else draw(st.sampled_from(["assistant", "tool"]))
        turns.append({"role": role, "content": draw(text)})
    return static + turns or [{"role": "user", "content": "x"}]


kwargs_strategy = st.one_of(
    st.none(),
    st.fixed_dictionaries({}, optional={
        "reasoning_effort": st.sampled_from(["low", "medium", "high"]),
        "enable_thinking": st.booleans(),
    }),
)

# One cache across examples, so later examples hit entries earlier ones stored.
CACHE = StaticPrefixCache()
_WRAPPERS: dict[int, Any] = {}


def renderer_for(tokenizer: Any, wrapped: bool) -> Any:
    """The tokenizer, or (one, reused) mlx-lm TokenizerWrapper around it when mlx-lm is here."""
    if not wrapped:
        return tokenizer
    try:
        from mlx_lm.tokenizer_utils import TokenizerWrapper
    except ImportError:
        return tokenizer
    return _WRAPPERS.setdefault(id(tokenizer), TokenizerWrapper(tokenizer))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    behaviour=st.sampled_from(sorted(BEHAVIOURS)),
    messages=conversations(),
    tools=tools_strategy(),
    kwargs=kwargs_strategy,
    give_prompt_ids=st.booleans(),
    wrapped=st.booleans(),
)
def test_hit_equals_uncached(qwen3, behaviour, messages, tools, kwargs, give_prompt_ids,
                             wrapped) -> None:
    template = BEHAVIOURS[behaviour]
    tok = renderer_for(qwen3, wrapped)
    expected = reference.exact(tok, messages, tools, kwargs, template=template)
    prompt = reference.render(tok, messages, tools, kwargs, template)
    ids = prompt if give_prompt_ids else None
    first = CACHE.resolve(tok, messages, tools, kwargs, prompt_ids=ids, chat_template=template)
    second = CACHE.resolve(tok, messages, tools, kwargs, prompt_ids=ids, chat_template=template)
    assert first.specprefill_system_end == second.specprefill_system_end == expected
    assert first.prompt_ids == second.prompt_ids == prompt
    assert second.cache in ("hit", "none")
    assert (first.cache == "none") == (second.cache == "none") == (first.key == "")


# -- issue 23: the classes an adversarial read found, searched for rather than listed ----------

SYSTEM_WORDS = ["Hello", " again", "agent", "You", " are", "tool", "<|im_end|>", "日本", "\n\n"]


@st.composite
def token_table_mutations(draw: Any) -> tuple[str, str, dict[str, bool]]:
    """(how, token text, flags): a vocabulary word made an added token, an added token re-added
    with other flags, or a new special token."""
    how = draw(st.sampled_from(["add", "add_special", "readd_existing"]))
    word = draw(st.sampled_from(SYSTEM_WORDS[:6] if how != "readd_existing"
                                else ["<|im_start|>", "<|im_end|>", "<think>", "<tool_call>"]))
    flags = {name: draw(st.booleans()) for name in ("lstrip", "rstrip", "single_word",
                                                     "normalized")}
    return how, word, flags


@pytest.fixture(scope="module")
def mutable_qwen3() -> Any:
    """A Qwen3 tokenizer of this module's own: the mutations accumulate on it."""
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    return copy.deepcopy(load_offline_tokenizer("qwen3"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=token_table_mutations(),
       system=st.lists(st.sampled_from(SYSTEM_WORDS), min_size=1, max_size=12).map("".join),
       user=text)
def test_token_table_mutations_never_keep_a_stale_key(mutable_qwen3, mutation, system, user
                                                      ) -> None:
    from tokenizers import AddedToken

    tok = mutable_qwen3
    template = BEHAVIOURS["default_system"]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    CACHE.resolve(tok, messages, chat_template=template)  # warm under the old table
    how, word, flags = mutation
    token = AddedToken(word, special=how != "add", **flags)
    if how == "add_special":
        tok.add_special_tokens({"additional_special_tokens": [token]},
                               replace_extra_special_tokens=False)
    else:
        tok.add_tokens([token], special_tokens=how == "readd_existing")
    expected = reference.exact(tok, messages, template=template)
    prompt = reference.render(tok, messages, None, None, template)
    for _ in range(2):
        result = CACHE.resolve(tok, messages, chat_template=template)
        assert (result.specprefill_system_end, result.prompt_ids) == (expected, prompt)


render_options = st.sampled_from([
    {}, {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_generation_prompt": True, "continue_final_message": True},  # refused
])
REQUEST_TEMPLATES = {
    "plain": "{%- for m in messages %}{{- '### ' + m.role + ':\\n' + (m.content or '') + '\\n\\n' }}"
             "{%- endfor %}{%- if add_generation_prompt %}{{- '### assistant:\\n' }}{%- endif %}",
    **BEHAVIOURS,
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(template_name=st.sampled_from(sorted(REQUEST_TEMPLATES)), messages=conversations(),
       tools=tools_strategy(), options=render_options, final=st.sampled_from(TRICKY[:3]))
def test_request_level_render_fields(qwen3, template_name, messages, tools, options, final
                                     ) -> None:
    """A request-level template and the flags that end the prompt: a hit equals the reference
    over that render, or the request is refused with a clear error."""
    from prefix_cache.errors import InvalidRequestError

    template = REQUEST_TEMPLATES[template_name]
    messages = [*messages, {"role": "assistant", "content": final + " then"}]
    if options.get("add_generation_prompt") and options.get("continue_final_message"):
        with pytest.raises(InvalidRequestError, match="continue_final_message"):
            CACHE.resolve(qwen3, messages, tools, chat_template=template, **options)
        return
    try:
        expected = reference.exact(qwen3, messages, tools, None, template, options)
        prompt = reference.render(qwen3, messages, tools, None, template, options=options)
    except Exception:  # the template itself refuses this conversation: so must the cache
        with pytest.raises(PrefixCacheError):
            CACHE.resolve(qwen3, messages, tools, chat_template=template, **options)
        return
    for _ in range(2):
        result = CACHE.resolve(qwen3, messages, tools, chat_template=template, **options)
        assert (result.specprefill_system_end, result.prompt_ids) == (expected, prompt)


DIRECTIVES = list("aAbBCdDeFgGhjmnuUVwWxyYzZt%HIklMpPRcfrsSTX") + ["-d", "Ey", "Q", "", "0H"]


@st.composite
def time_formats(draw: Any) -> str:
    parts = draw(st.lists(st.one_of(st.sampled_from(["%" + d for d in DIRECTIVES]),
                                    st.sampled_from([" ", ":", "-", "T", "at"])),
                          min_size=1, max_size=5))
    return "".join(parts)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=time_formats(), times=st.lists(st.tuples(st.integers(0, 23), st.integers(0, 59),
                                                    st.integers(0, 59)), min_size=2, max_size=4))
def test_time_formats_in_templates(qwen3, monkeypatch, fmt, times) -> None:
    """strftime_now at any granularity: every answer equals the reference at that time; a hit
    only when the template's own formats print the same; below a minute, never cached."""
    from tests.support.clock import fake_template_clock
    from tests.support.templates import LONG_SYSTEM, clock_template

    clock = fake_template_clock(monkeypatch)
    template = clock_template(f"strftime_now({fmt!r})")
    messages = [LONG_SYSTEM, {"role": "user", "content": "Hi"}]
    cache = StaticPrefixCache()
    seen: dict[str, str] = {}
    for hour, minute, second in times:
        clock.set(hour, minute, second)
        result = cache.resolve(qwen3, messages, chat_template=template)
        assert result.specprefill_system_end == reference.exact(qwen3, messages, template=template)
        printed = clock.at.strftime(fmt)
        if result.key == "":  # not cacheable: never a hit
            assert result.cache == "miss" and result.uncacheable
        else:
            assert result.cache == ("hit" if printed in seen else "miss")
            assert seen.setdefault(printed, result.key) == result.key


def _non_json_values() -> Any:
    import msgpack

    return st.one_of(
        st.binary(max_size=8), st.binary(max_size=8).map(bytearray),
        st.binary(max_size=8).map(memoryview),
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20)),
        st.builds(msgpack.Timestamp, st.integers(0, 2**40), st.integers(0, 999_999_999)),
        st.tuples(st.integers()), st.sets(st.integers(), max_size=2),
    )


json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=False), st.text(max_size=12))
json_values = st.recursive(json_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


@st.composite
def with_planted(draw: Any, value: Any, planted: Any) -> Any:
    """``value`` with ``planted`` put somewhere inside it (or ``planted`` itself)."""
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], draw(with_planted(value[i], planted)), *value[i + 1:]]
    if isinstance(value, dict) and value and draw(st.booleans()):
        k = draw(st.sampled_from(sorted(value)))
        return {**value, k: draw(with_planted(value[k], planted))}
    return [value, planted] if draw(st.booleans()) else {"v": planted}


WHERE = st.sampled_from(["kwargs", "tools", "static", "no static part"])


def _request(where: str, value: Any) -> tuple[list[dict], list | None, dict | None]:
    system = {"role": "system", "content": "You are the agent."}
    user = {"role": "user", "content": "Hi"}
    if where == "kwargs":
        return [system, user], None, {"x": value}
    if where == "tools":
        return [system, user], [{"type": "function", "function": {"name": "f", "x": value}}], None
    if where == "static":
        return [{**system, "meta": value}, user], None, None
    return [user], None, {"x": value}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), base=json_values, planted=_non_json_values(), where=WHERE)
def test_binary_and_extension_values_are_refused(qwen3, data, base, planted, where) -> None:
    from prefix_cache.errors import InvalidRequestError

    value = data.draw(with_planted(base, planted))
    messages, tools, kwargs = _request(where, value)
    with pytest.raises(InvalidRequestError, match="not plain JSON data"):
        CACHE.resolve(qwen3, messages, tools, kwargs, chat_template=BEHAVIOURS["default_system"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=json_values, where=WHERE)
def test_plain_json_values_key_exactly(qwen3, value, where) -> None:
    """Plain data of every kind (numbers and text whose packed bytes look binary included)."""
    messages, tools, kwargs = _request(where, value)
    template = BEHAVIOURS["default_system"]
    expected = reference.exact(qwen3, messages, tools, kwargs, template)
    first = CACHE.resolve(qwen3, messages, tools, kwargs, chat_template=template)
    second = CACHE.resolve(qwen3, messages, tools, kwargs, chat_template=template)
    assert first.specprefill_system_end == second.specprefill_system_end == expected
    assert second.cache in ("hit", "none")


surrogates = st.integers(0xD800, 0xDFFF).map(chr)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=text, after=text, surrogate=surrogates,
       where=st.sampled_from(["static", "user", "kwargs", "tools", "no static part"]))
def test_lone_surrogates_are_invalid_requests(qwen3, before, after, surrogate, where) -> None:
    from prefix_cache.errors import InvalidRequestError

    bad = before + surrogate + after
    messages, tools, kwargs = _request("no static part" if where == "no static part" else
                                       "kwargs" if where == "kwargs" else
                                       "tools" if where == "tools" else "static", bad)
    if where == "static":
        messages = [{"role": "system", "content": bad}, messages[1]]
    elif where == "user":
        messages = [messages[0], {"role": "user", "content": bad}]
    elif where == "no static part":
        messages, kwargs = [{"role": "user", "content": bad}], None
    cache = StaticPrefixCache()
    with pytest.raises(InvalidRequestError, match="surrogate"):
        cache.resolve(qwen3, messages, tools, kwargs, chat_template=BEHAVIOURS["default_system"])
    assert cache.stats.errors == 1

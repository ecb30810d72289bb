"""The five holes of issue 23, one test (or table) each: every one a hit that differed from the
uncached answer, or an input that escaped the error path. Each is checked against the
independent reference (tests/support/reference.py) over the real render."""

from __future__ import annotations

import copy
from typing import Any

import msgpack
import pytest

from prefix_cache import StaticPrefixCache
from prefix_cache.errors import InvalidRequestError

from tests.support import reference
from tests.support.paths import SHARED_TEMPLATES
from tests.support.clock import FakeClock, fake_template_clock
from tests.support.templates import DEFAULT_SYSTEM, LONG_SYSTEM, clock_template

HELLO_SYSTEM = "Hello! You are the assistant. Hello again, and Hello once more: say Hello."


def _fresh_qwen3() -> Any:
    """A Qwen3 tokenizer of its own: these tests change it."""
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    return copy.deepcopy(load_offline_tokenizer("qwen3"))


def _qwen3_template() -> str:
    path = SHARED_TEMPLATES / "Qwen-Qwen3-0.6B.jinja"
    if not path.exists():
        return DEFAULT_SYSTEM
    return path.read_text("utf-8")


# -- 1. the tokenizer's added-tokens table ---------------------------------------------------


@pytest.mark.parametrize("change", ["vocab_token_added", "flags_changed", "special_added"])
def test_added_tokens_table_changes_are_seen(change: str) -> None:
    from tokenizers import AddedToken

    tok = _fresh_qwen3()
    template = _qwen3_template()
    messages = [{"role": "system", "content": HELLO_SYSTEM}, {"role": "user", "content": "Hi"}]
    cache = StaticPrefixCache()
    before = cache.resolve(tok, messages, chat_template=template)
    if change == "vocab_token_added":  # "Hello" is in the vocabulary: len(tok) does not move
        size = len(tok)
        assert tok.add_tokens([AddedToken("Hello", normalized=False)]) == 1
        assert len(tok) == size
    elif change == "flags_changed":  # an added token re-added with other flags
        tok.add_tokens([AddedToken("<|im_start|>", lstrip=True, rstrip=True, normalized=False,
                                   special=True)])
    else:
        tok.add_special_tokens({"additional_special_tokens": [" again"]},
                               replace_extra_special_tokens=False)
    after = cache.resolve(tok, messages, chat_template=template)
    assert after.key != before.key and after.cache == "miss"
    assert after.prompt_ids == reference.render(tok, messages, None, None, template)
    assert after.specprefill_system_end == reference.exact(tok, messages, template=template)
    again = cache.resolve(tok, messages, chat_template=template)
    assert again.cache == "hit" and again.specprefill_system_end == after.specprefill_system_end


# -- 4. binary and extension values ----------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are the agent."}
USER = {"role": "user", "content": "Hi"}

NON_JSON = {
    "bytes": b"abc",
    "empty bytes": b"",
    "bytearray": bytearray(b"abc"),
    "memoryview": memoryview(b"abc"),
    "ExtType like a big int": msgpack.ExtType(1, b"18446744073709551616"),
    "ExtType": msgpack.ExtType(5, b""),
    "Timestamp": msgpack.Timestamp(1, 5),
    "Timestamp 96-bit": msgpack.Timestamp(2**40, 1),
}


@pytest.mark.parametrize("value", list(NON_JSON.values()), ids=list(NON_JSON))
@pytest.mark.parametrize("where", ["kwargs", "tools", "static", "no static part"])
def test_binary_and_extension_values_are_refused(qwen3, value: Any, where: str) -> None:
    cache = StaticPrefixCache()
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    tools, kwargs = None, None
    if where == "kwargs":
        kwargs = {"tag": value}
    elif where == "tools":
        tools = [{"type": "function", "function": {"name": "f", "x": [1, {"y": value}]}}]
    elif where == "static":
        messages = [{**SYSTEM, "meta": value}, USER]
    else:
        messages, kwargs = [USER], {"tag": value}
    with pytest.raises(InvalidRequestError, match="not plain JSON data"):
        cache.resolve(qwen3, messages, tools, kwargs, chat_template=DEFAULT_SYSTEM)
    assert cache.stats.errors == 1


def test_bytes_then_bytearray_is_not_a_hit(qwen3) -> None:
    """The issue's example: it used to be a hit with another render's boundary."""
    cache = StaticPrefixCache()
    for value in (b"abc", bytearray(b"abc")):
        with pytest.raises(InvalidRequestError):
            cache.resolve(qwen3, [SYSTEM, USER], None, {"tag": value},
                          chat_template=DEFAULT_SYSTEM)
    assert cache.stats.hits == 0


@pytest.mark.parametrize("value", [200, 0.7, -1.5e300, 50176, "ĀāĄą ăĆ שלום مرحبا", 2**64,
                                   {"n": [199, 201, 0.25]}])
def test_plain_values_with_binary_looking_bytes_still_key(qwen3, value: Any) -> None:
    """Numbers and text whose msgpack bytes look like a bin or ext type byte are plain data."""
    cache = StaticPrefixCache()
    first = cache.resolve(qwen3, [SYSTEM, USER], None, {"v": value}, chat_template=DEFAULT_SYSTEM)
    second = cache.resolve(qwen3, [SYSTEM, USER], None, {"v": value}, chat_template=DEFAULT_SYSTEM)
    assert (first.cache, second.cache) == ("miss", "hit")


# -- 5. lone surrogates ----------------------------------------------------------------------


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "a\ud800b"}, USER],
    [{"role": "system", "content": [{"type": "text", "text": "\udfff"}]}, USER],
    [SYSTEM, {"role": "user", "content": "x\ud800"}],
    [{"role": "user", "content": "x\udc80"}],
], ids=["static", "static part", "user", "no static part"])
def test_lone_surrogate_is_an_invalid_request_and_counted(qwen3, messages: list[dict]) -> None:
    cache = StaticPrefixCache()
    with pytest.raises(InvalidRequestError, match="surrogate"):
        cache.resolve(qwen3, messages, chat_template=DEFAULT_SYSTEM)
    assert cache.stats.errors == 1


def test_lone_surrogate_in_kwargs_and_tools(qwen3) -> None:
    cache = StaticPrefixCache()
    with pytest.raises(InvalidRequestError, match="surrogate"):
        cache.resolve(qwen3, [SYSTEM, USER], None, {"name": "\ud83d"}, chat_template=DEFAULT_SYSTEM)
    with pytest.raises(InvalidRequestError, match="surrogate"):
        cache.resolve(qwen3, [SYSTEM, USER], [{"type": "function", "function": {"\ud83d": 1}}],
                      chat_template=DEFAULT_SYSTEM)
    assert cache.stats.errors == 2


# -- 3. the clock and randomness in templates --------------------------------------------------


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    return fake_template_clock(monkeypatch)




def test_minute_format_is_keyed_by_the_minute(qwen3, clock: FakeClock) -> None:
    template = clock_template("strftime_now('%H:%M')")
    messages = [LONG_SYSTEM, USER]
    cache = StaticPrefixCache()
    seen = []
    for hour, minute, second in ((10, 0, 5), (10, 0, 40), (10, 1, 2), (11, 1, 2)):
        clock.set(hour, minute, second)
        result = cache.resolve(qwen3, messages, chat_template=template)
        assert result.specprefill_system_end == reference.exact(qwen3, messages, template=template)
        assert result.prompt_ids == reference.render(qwen3, messages, None, None, template)
        seen.append((result.cache, result.key))
    assert [c for c, _ in seen] == ["miss", "hit", "miss", "miss"]
    assert seen[0][1] == seen[1][1] != seen[2][1] != seen[3][1]


@pytest.mark.parametrize("expression", [
    "strftime_now('%H:%M:%S')", "strftime_now('%s')", "strftime_now('%Y %f')",
    "strftime_now('%H' ~ ':%M')", "([sys, 'x', 'y'] | random)", "lipsum(1, false)",
])
def test_unreproducible_renders_are_never_cached(qwen3, clock: FakeClock, expression: str) -> None:
    """The issue's example: '%H:%M:%S' was a hit a second later with another render's boundary."""
    template = clock_template(expression)
    messages = [LONG_SYSTEM, USER]
    cache = StaticPrefixCache()
    for second in (5, 6):
        clock.set(10, 0, second)
        result = cache.resolve(qwen3, messages, chat_template=template)
        assert (result.cache, result.key) == ("miss", "") and result.uncacheable
        if "random" not in expression and "lipsum" not in expression:  # the fake clock fixes it
            assert result.specprefill_system_end == reference.exact(qwen3, messages,
                                                                    template=template)
    assert len(cache.store) == 0  # type: ignore[arg-type]
    assert cache.stats.hits == 0 and cache.stats.misses == 2


async def test_unreproducible_render_async_is_never_cached(qwen3, clock: FakeClock) -> None:
    template = clock_template("strftime_now('%T')")
    cache = StaticPrefixCache()
    for _ in range(2):
        result = await cache.aresolve(qwen3, [LONG_SYSTEM, USER], chat_template=template)
        assert (result.cache, result.key) == ("miss", "")
        assert result.specprefill_system_end == reference.exact(qwen3, [LONG_SYSTEM, USER],
                                                                template=template)

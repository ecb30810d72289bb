"""The fast-path switch: ``PREFIX_CACHE_FAST_PATH=on|off`` and ``StaticPrefixCache(fast_path=)``.

The property every accelerator keeps: over generated conversations, tools (plain and frozen),
kwargs, tokenizer states (attributes set after loading, added tokens), template features and the
body parser's packed parts, the answer with the fast path on equals the answer with it off, on a
miss, on a hit, and on a hit of an entry the other side stored.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_cache import FrozenTools, MemoryStore, StaticPrefixCache
from prefix_cache.fastpath import PartMemo, parse_body
from prefix_cache.errors import PrefixCacheError
from prefix_cache.fastpath import FAST_PATH_ENV
from tests.core.test_property import conversations, kwargs_strategy, tools_strategy
from tests.support.templates import BEHAVIOURS, LONG_SYSTEM

# -- the switch ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "on"), [(None, True), ("on", True), ("off", False)])
def test_the_environment_sets_the_default(monkeypatch, value, on) -> None:
    if value is None:
        monkeypatch.delenv(FAST_PATH_ENV, raising=False)
    else:
        monkeypatch.setenv(FAST_PATH_ENV, value)
    assert StaticPrefixCache().fast_path is on
    assert StaticPrefixCache(fast_path=not on).fast_path is (not on)  # the argument wins


@pytest.mark.parametrize("value", ["ON", "Off", "1", "0", "true", "", " on", "yes"])
def test_any_other_value_is_refused_by_name(monkeypatch, value) -> None:
    monkeypatch.setenv(FAST_PATH_ENV, value)
    with pytest.raises(ValueError, match=f"{FAST_PATH_ENV} must be 'on' or 'off', got {value!r}"):
        StaticPrefixCache()


@pytest.mark.parametrize("value", [1, 0, "off", "on"])
def test_the_argument_takes_a_bool_only(value) -> None:
    with pytest.raises(ValueError, match=f"fast_path must be True, False or None, got {value!r}"):
        StaticPrefixCache(fast_path=value)


# -- on == off -----------------------------------------------------------------------------------

# Templates beyond the behaviours (two of which read the clock): tojson with arguments.
FEATURES = {
    **BEHAVIOURS,
    "tojson_indent": BEHAVIOURS["default_system"].replace("(t | tojson)", "(t | tojson(indent=2))"),
    "tojson_sorted": BEHAVIOURS["tools_first"].replace(
        "t | tojson", "t | tojson(sort_keys=true, separators=(',', ':'))"),
}
# What the static part may be: the drawn conversation's, or a long one (it gets a split).
STATICS = st.sampled_from([None, LONG_SYSTEM])
STATES = st.sampled_from(["as_loaded", "split_special_after_load", "added_token"])


@pytest.fixture(scope="module")
def state_tokenizers(qwen3) -> dict[str, Any]:
    """Tokenizers of this module's own, one per state, made once (a copy costs ~1 s)."""
    split = copy.deepcopy(qwen3)
    added = copy.deepcopy(qwen3)
    added.add_tokens(["You are", " the agent"])
    return {"as_loaded": qwen3, "split_special_after_load": split, "added_token": added}


def _state(tokenizers: dict[str, Any], state: str) -> Any:
    tok = tokenizers[state]
    if state == "split_special_after_load":
        # A loaded tokenizer keeps this flag on its Python object; transformers copies it to the
        # Rust backend only on its next encode. Setting both apart each time puts the tokenizer
        # back in the state it has between ``tok.split_special_tokens = True`` and its first use.
        tok.split_special_tokens = True
        tok.backend_tokenizer.encode_special_tokens = False
    return tok


def _answer(result: Any) -> tuple[Any, ...]:
    return (result.specprefill_system_end, result.prompt_ids, result.key, result.static_tokens,
            result.uncacheable)


def _run(cache: StaticPrefixCache, tok: Any, body: dict[str, Any], frozen: bool,
         via_body: bool, ids: list[int] | None) -> Any:
    """One resolve: through ``resolve``, or through ``aresolve`` with the body parser's parts;
    the tokenizer put back in its drawn state first (``_state``)."""
    tok = _state(*tok)
    tools = body.get("tools")
    if frozen and tools is not None:
        tools = FrozenTools(tools)
    if not via_body:
        try:
            return cache.resolve(tok, body["messages"], tools, body.get("chat_template_kwargs"),
                                 prompt_ids=ids, chat_template=body["template"])
        except PrefixCacheError as exc:
            return type(exc), str(exc)
    raw = orjson.dumps({k: v for k, v in body.items() if k != "template"})
    data, hints = parse_body(raw, _MEMO, "default", share=True)

    async def go() -> Any:
        return await cache.aresolve(tok, data["messages"], data.get("tools"),
                                    data.get("chat_template_kwargs"), prompt_ids=ids,
                                    chat_template=body["template"], hints=hints)
    try:
        return asyncio.run(go())
    except PrefixCacheError as exc:
        return type(exc), str(exc)


_MEMO = PartMemo()


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(feature=st.sampled_from(sorted(FEATURES)), messages=conversations(), static=STATICS,
       tools=tools_strategy(), kwargs=kwargs_strategy, state=STATES, frozen=st.booleans(),
       via_body=st.booleans(), give_ids=st.booleans(), off_first=st.booleans())
def test_fast_path_on_equals_off(state_tokenizers, feature, messages, static, tools, kwargs,
                                 state, frozen, via_body, give_ids, off_first) -> None:
    tok = (state_tokenizers, state)
    if static is not None:
        messages = [static, *messages]
    body: dict[str, Any] = {"messages": messages, "template": FEATURES[feature]}
    if tools is not None:
        body["tools"] = tools
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    ids = None
    if give_ids:
        first = _run(StaticPrefixCache(fast_path=False), tok, body, False, False, None)
        if isinstance(first, tuple):
            return  # the request is refused; the same refusal is compared below without ids
        ids = first.prompt_ids
    on_store, off_store = MemoryStore(), MemoryStore()
    on, off = StaticPrefixCache(on_store, fast_path=True), StaticPrefixCache(off_store,
                                                                               fast_path=False)
    order = [(off, "off"), (on, "on")] if off_first else [(on, "on"), (off, "off")]
    for _round in ("miss", "hit"):
        answers = {name: _run(cache, tok, body, frozen, via_body, ids) for cache, name in order}
        if isinstance(answers["on"], tuple) or isinstance(answers["off"], tuple):
            assert answers["on"] == answers["off"]
            return
        assert _answer(answers["on"]) == _answer(answers["off"])
        assert answers["on"].cache == answers["off"].cache
    # Each side reading the entry the other stored: a hit, the same answer.
    crossed = [_run(StaticPrefixCache(store, fast_path=fast), tok, body, frozen, via_body, ids)
               for store, fast in ((on_store, False), (off_store, True))]
    assert _answer(crossed[0]) == _answer(crossed[1]) == _answer(answers["on"])
    assert crossed[0].cache == crossed[1].cache == answers["on"].cache

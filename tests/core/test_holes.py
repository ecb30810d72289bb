"""The four classes where the answer and the accelerators disagreed (issue 37), each closed as a
class and tested over more than the case that was reported:

1. tokenizer state is read once per call, when the key reads it (not from a backend flag that
   transformers copies only on its next encode);
2. memo keys carry types (``2``, ``2.0`` and ``True`` are three keys);
3. randomness is caught where it happens, whatever syntax reached it;
4. array-likes that are not plain integer arrays are refused.
"""

from __future__ import annotations

import copy
from array import array
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_cache import MemoryStore, StaticPrefixCache
from prefix_cache.errors import InvalidRequestError, TemplateRenderError
from prefix_cache.fastpath.typed_keys import Unkeyable, typed_key
from tests.support import reference
from tests.support.templates import BEHAVIOURS
from tests.support.tools import make_tools

TEMPLATE = BEHAVIOURS["default_system"]
# Many lines: the static text has line splits (kept when special tokens are split).
SYSTEM = {"role": "system", "content": "\n".join(
    f"Rule {i}: keep the build green and the tests honest." for i in range(8))}

# -- 1. tokenizer state ----------------------------------------------------------------------------

TAIL_WORDS = ["Hi", " ", "<|im_end|>", "<|im_start|>", "x", "\n", " there", "<think>", "日本"]


@pytest.fixture(scope="module")
def split_tokenizers(qwen3) -> tuple[Any, Any]:
    """Two copies of qwen3 with ``split_special_tokens`` set after loading: one that stores
    entries, and one only ever used on hits."""
    stores, hits = copy.deepcopy(qwen3), copy.deepcopy(qwen3)
    stores.split_special_tokens = hits.split_special_tokens = True
    return stores, hits


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.lists(st.sampled_from(TAIL_WORDS), max_size=8).map("".join),
                      min_size=1, max_size=3))
def test_a_flag_set_after_loading_is_used_on_a_first_hit(split_tokenizers, turns) -> None:
    stores, hits = split_tokenizers
    messages = [SYSTEM] + [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                           for i, t in enumerate(turns)]
    store = MemoryStore()
    StaticPrefixCache(store, tokenize_check_rate=0).resolve(stores, messages,
                                                             chat_template=TEMPLATE)
    # The state a tokenizer has between ``tok.split_special_tokens = True`` and its first
    # encode: transformers has not copied the flag to its backend yet.
    hits.backend_tokenizer.encode_special_tokens = False
    hit = StaticPrefixCache(store, tokenize_check_rate=0).resolve(hits, messages,
                                                                   chat_template=TEMPLATE)
    assert hit.cache == "hit"
    assert hit.prompt_ids == reference.render(hits, messages, None, None, TEMPLATE)
    assert hit.specprefill_system_end == reference.exact(hits, messages, template=TEMPLATE)


def test_a_flag_changed_between_calls_changes_the_key_and_the_ids(qwen3) -> None:
    tok = copy.deepcopy(qwen3)
    messages = [SYSTEM, {"role": "user", "content": "Hi <|im_end|> there"}]
    cache = StaticPrefixCache(tokenize_check_rate=0)
    answers = {}
    for flag in (False, True, False, True):
        tok.split_special_tokens = flag
        result = cache.resolve(tok, messages, chat_template=TEMPLATE)
        assert result.prompt_ids == reference.render(tok, messages, None, None, TEMPLATE)
        answers.setdefault(flag, result.key)
        assert answers[flag] == result.key
    assert answers[True] != answers[False]


# -- 2. memo keys carry types ------------------------------------------------------------------------

ARGUMENTS = [2, 2.0, True, 1, 0, False, None, " ", "\t", [",", ":"], (",", ":"), ("; ", "= ")]


def test_typed_keys_tell_equal_values_of_other_types_apart() -> None:
    assert len({typed_key(v) for v in (2, 2.0, True, 1, 1.0)}) == 5
    assert typed_key([1, 2]) != typed_key((1, 2))
    assert typed_key([1, [True]]) != typed_key([1, [1]])
    with pytest.raises(Unkeyable):
        typed_key({"a": 1})


def _tojson_twice(name: str, first: Any, second: Any) -> str:
    """TOOLS_FIRST with each tool printed by tojson with two argument values."""
    def call(value: Any) -> str:
        return f"t | tojson({name}={value!r})" if not isinstance(value, list) else \
            f"t | tojson({name}=[{', '.join(map(repr, value))}])"
    return BEHAVIOURS["tools_first"].replace("{{- t | tojson }}",
                                             "{{- " + call(first) + " }}{{- " + call(second) + " }}")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["indent", "separators", "ensure_ascii", "sort_keys"]),
       first=st.sampled_from(ARGUMENTS), second=st.sampled_from(ARGUMENTS))
def test_tojson_arguments_equal_but_of_other_types(qwen3, name, first, second) -> None:
    """A miss, a hit, and the fast path off all answer as transformers does (or refuse alike)."""
    template = _tojson_twice(name, first, second)
    messages = [SYSTEM, {"role": "user", "content": "Go"}]
    tools = make_tools(2)
    try:
        expected: Any = reference.render(qwen3, messages, tools, None, template)
    except Exception:
        expected = TemplateRenderError
    cache, off = StaticPrefixCache(tokenize_check_rate=0), StaticPrefixCache(fast_path=False)
    for run in (cache, cache, off):
        if expected is TemplateRenderError:
            with pytest.raises(TemplateRenderError):
                run.resolve(qwen3, messages, tools, chat_template=template)
        else:
            assert run.resolve(qwen3, messages, tools, chat_template=template).prompt_ids == expected


# -- 3. randomness where it happens ------------------------------------------------------------------

# Ways to reach Jinja's random filter and lipsum, most of them invisible to a syntax check.
DRAWS = {
    "filter": "{{- [1, 2, 3] | random }}",
    "map": "{{- [[1, 2], [3, 4]] | map('random') | join(',') }}",
    "built_name": "{{- [[1, 2], [3, 4]] | map('ran' ~ 'dom') | join(',') }}",
    "lipsum_call": "{{- lipsum(1, false, 3, 5) }}",
    "lipsum_value": "{%- set f = lipsum %}{{- f(1, false, 3, 5) }}",
    "lipsum_in_list": "{%- set fs = [lipsum] %}{{- fs[0](1, false, 3, 5) }}",
}


def _drawing(draw: str, only_when: bool) -> str:
    """DEFAULT_SYSTEM drawing in its system turn (only when the kwarg ``draw`` is set)."""
    expression = "{%- if draw is defined %}" + draw + "{%- endif %}" if only_when else draw
    return TEMPLATE.replace("{{- '<|im_end|>\\n' }}\n{%- for m", expression +
                            "{{- '<|im_end|>\\n' }}\n{%- for m", 1)


@pytest.mark.parametrize("how", sorted(DRAWS))
@pytest.mark.parametrize("fast_path", [True, False])
def test_a_render_that_draws_at_random_is_never_cached(qwen3, how, fast_path) -> None:
    template = _drawing(DRAWS[how], only_when=False)
    assert template != TEMPLATE
    tok = copy.deepcopy(qwen3)  # a renderer of its own, never marked by another test
    store = MemoryStore()
    cache = StaticPrefixCache(store, fast_path=fast_path)
    messages = [SYSTEM, {"role": "user", "content": "Hi"}]
    results = [cache.resolve(tok, messages, chat_template=template) for _ in range(3)]
    assert all(r.cache == "miss" for r in results)
    assert results[-1].uncacheable and results[-1].key == ""
    assert store.keys() == []


@pytest.mark.parametrize("how", ["map", "lipsum_value"])
def test_a_draw_on_some_requests_only_stops_caching_from_then_on(qwen3, how) -> None:
    template = _drawing(DRAWS[how], only_when=True)
    tok = copy.deepcopy(qwen3)
    store = MemoryStore()
    cache = StaticPrefixCache(store)
    messages = [SYSTEM, {"role": "user", "content": "Hi"}]
    plain = [cache.resolve(tok, messages, chat_template=template) for _ in range(2)]
    assert [r.cache for r in plain] == ["miss", "hit"] and not plain[1].uncacheable
    stored = store.keys()
    drawn = [cache.resolve(tok, messages, None, {"draw": 1}, chat_template=template)
             for _ in range(2)]
    assert [r.cache for r in drawn] == ["miss", "miss"] and drawn[1].uncacheable
    assert store.keys() == stored  # nothing stored for the render that drew


# -- 4. array-likes ----------------------------------------------------------------------------------


class _IdList(list):
    """A list subclass: iterating it may give other values than its items."""


REFUSED = {
    "masked": lambda ids: np.ma.masked_array(ids, mask=[i % 2 for i in range(len(ids))]),
    "masked_unmasked": lambda ids: np.ma.masked_array(ids),
    "object": lambda ids: np.array(ids, dtype=object),
    "float": lambda ids: np.array(ids, dtype=np.float64),
    "bool": lambda ids: np.array([bool(i) for i in ids]),
    "matrix": lambda ids: np.array([ids]).view(np.matrix),
    "two_dimensional": lambda ids: np.array([ids]),
    "memmap_like_subclass": lambda ids: np.array(ids).view(type("Sub", (np.ndarray,), {})),
    "double_array": lambda ids: array("d", ids),
    "list_subclass": _IdList,
    "memoryview": lambda ids: memoryview(array("I", ids)),
    "string": lambda ids: " ".join(map(str, ids)),
    "dict": lambda ids: dict(enumerate(ids)),
}
ACCEPTED = {
    "int32": lambda ids: np.array(ids, dtype=np.int32),
    "uint64": lambda ids: np.array(ids, dtype=np.uint64),
    "big_endian": lambda ids: np.array(ids, dtype=">i4"),
    "strided": lambda ids: np.repeat(np.array(ids, dtype=np.int64), 2)[::2],
    "uint32_array": lambda ids: array("I", ids),
    "tuple": tuple,
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_array_likes_that_are_not_plain_integer_arrays_are_refused(qwen3, kind) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Hi"}]
    ids = reference.render(qwen3, messages, None, None, TEMPLATE)
    cache = StaticPrefixCache()
    for _ in range(2):  # on a miss and with the entry stored
        with pytest.raises(InvalidRequestError, match="prompt_ids"):
            cache.resolve(qwen3, messages, prompt_ids=REFUSED[kind](ids), chat_template=TEMPLATE)
        cache.resolve(qwen3, messages, chat_template=TEMPLATE)


@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_plain_integer_arrays_are_used_as_given(qwen3, kind) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Hi"}]
    ids = reference.render(qwen3, messages, None, None, TEMPLATE)
    result = StaticPrefixCache().resolve(qwen3, messages, prompt_ids=ACCEPTED[kind](ids),
                                         chat_template=TEMPLATE)
    assert result.prompt_ids == ids
    assert result.specprefill_system_end == reference.exact(qwen3, messages, template=TEMPLATE)

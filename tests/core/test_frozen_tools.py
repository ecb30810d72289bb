"""``FrozenTools``: a tool list frozen once answers exactly as the same plain list, and nothing a
caller does after freezing it changes what it keys or renders."""

from __future__ import annotations

import asyncio
import copy
import math
from enum import Enum
from typing import Any

import numpy as np
import pytest

from prefix_cache import FrozenTools, InvalidRequestError, StaticPrefixCache
from prefix_cache.render.render import get_renderer
from tests.support.templates import TOOLS_FIRST, TOOLS_IN_FIRST_USER, TOOLS_NOT_NONE
from tests.support.tools import make_tools

SYSTEM = {"role": "system", "content": "You are the release agent."}


def conv(text: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": text}]


ODD_TOOL = {"type": "function", "function": {
    "name": "odd", "parameters": {"big": 2**80, "neg": -(2**70), "one": 1, "float": 1.0,
                                  "flag": True, "zero": -0.0, "nan": math.nan, "none": None,
                                  "text": "é\u0301 🙂", "nested": [[], {}, [1, [2.5]]]}}}


@pytest.mark.parametrize("template", [TOOLS_FIRST, TOOLS_IN_FIRST_USER, TOOLS_NOT_NONE])
@pytest.mark.parametrize("tools", [make_tools(6, seed=3), [ODD_TOOL, *make_tools(2)], []])
def test_frozen_answers_as_the_plain_list(qwen3: Any, template: str,
                                          tools: list[dict[str, Any]]) -> None:
    frozen = FrozenTools(tools)
    for text in ("Ship it.", "Roll back."):
        plain_cache, frozen_cache = StaticPrefixCache(), StaticPrefixCache()
        expected = plain_cache.resolve(qwen3, conv(text), tools, chat_template=template)
        for _ in range(2):  # the miss, then the hit
            got = frozen_cache.resolve(qwen3, conv(text), frozen, chat_template=template)
            assert (got.key, got.specprefill_system_end, got.prompt_ids) == (
                expected.key, expected.specprefill_system_end, expected.prompt_ids)
        ids = np.asarray(expected.prompt_ids, dtype=np.uint32)
        hit = frozen_cache.resolve(qwen3, conv(text), frozen, prompt_ids=ids,
                                   chat_template=template)
        assert hit.hit and hit.specprefill_system_end == expected.specprefill_system_end
        again = asyncio.run(frozen_cache.aresolve(qwen3, conv(text), frozen,
                                                  chat_template=template))
        assert again.hit and again.prompt_ids == expected.prompt_ids


def test_empty_frozen_tools_key_as_empty_not_none(qwen3: Any) -> None:
    cache = StaticPrefixCache()
    keys = {name: cache.resolve(qwen3, conv("Hi"), tools, chat_template=TOOLS_NOT_NONE).key
            for name, tools in (("none", None), ("empty", []), ("frozen", FrozenTools([])))}
    assert keys["empty"] == keys["frozen"] != keys["none"]


def test_nothing_done_after_freezing_changes_it(qwen3: Any) -> None:
    tools = make_tools(4, seed=5)
    before = copy.deepcopy(tools)
    frozen = FrozenTools(tools)
    tools[0]["function"]["name"] = "changed"   # the caller's own list
    tools.append({"type": "function"})
    read = frozen[0]
    read["function"]["name"] = "changed too"   # what reading it gave
    for tool in frozen:
        tool.clear()
    listed = list(frozen)
    listed.pop()
    assert frozen.unfrozen() == before and len(frozen) == 4
    cache = StaticPrefixCache()
    assert cache.resolve(qwen3, conv("Hi"), frozen, chat_template=TOOLS_FIRST).key == \
        cache.resolve(qwen3, conv("Hi"), before, chat_template=TOOLS_FIRST).key


def test_reading_gives_back_exactly_the_values_frozen() -> None:
    frozen = FrozenTools([ODD_TOOL])
    (tool,) = frozen.unfrozen()
    params, expected = tool["function"]["parameters"], ODD_TOOL["function"]["parameters"]
    assert list(params) == list(expected)  # key order
    for name, value in expected.items():
        got = params[name]
        assert type(got) is type(value) and (got == value or (got != got and value != value))
    assert math.copysign(1, params["zero"]) == -1
    assert FrozenTools(frozen) == frozen and hash(FrozenTools(frozen)) == hash(frozen)
    assert frozen != FrozenTools([]) and "1 tools" in repr(frozen)


class Color(Enum):
    RED = "red"


@pytest.mark.parametrize("tools, message", [
    ({"type": "function"}, "list of tool objects"),
    ([["not", "a", "dict"]], "list of tool objects"),
    (({"type": "function"},), "list of tool objects"),
    ([{"type": "function", "x": (1, 2)}], "tuple"),
    ([{"type": "function", "x": Color.RED}], "Color"),
    ([{"type": "function", "x": b"bytes"}], "bytes"),
    ([{"type": "function", "x": "\ud800"}], "lone surrogate"),
])
def test_what_a_key_refuses_cannot_be_frozen(tools: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        FrozenTools(tools)


def test_renders_get_their_own_copy(qwen3: Any) -> None:
    """Each read of a frozen list is a new list of new objects: a renderer cannot reach the
    bytes the key was made from."""
    frozen = FrozenTools(make_tools(2))
    first, second = list(frozen), list(frozen)
    assert first == second and first[0] is not second[0] and first is not second
    renderer = get_renderer(qwen3, TOOLS_FIRST, frozen)
    assert renderer.render_ids(conv("Hi"), frozen, {}) == renderer.render_ids(
        conv("Hi"), frozen.unfrozen(), {})

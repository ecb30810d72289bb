"""Property: over random conversations, tools and kwargs, rendered by a tokenizer or by an mlx-lm
TokenizerWrapper, a hit equals the uncached answer, and both equal the reference over the
renderer's own render."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_cache import StaticPrefixCache

from . import reference
from .conftest import make_tools
from .templates import BEHAVIOURS

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

"""The boundary on templates modelling each real behaviour, against independent references."""

from __future__ import annotations

import pytest

from prefix_cache import StaticPrefixCache, TemplateRenderError, common_prefix_len
from prefix_cache.cache.boundary import PROBE_A, PROBE_B, static_prefix_ids, system_end

from tests.support import reference
from tests.support.templates import BEHAVIOURS, NO_SYSTEM_ROLE
from tests.support.tools import make_tools

SYSTEM = {"role": "system", "content": "You are the build agent. Follow the repository rules."}
USER1 = {"role": "user", "content": "Please list the failing tests."}
ASSISTANT = {"role": "assistant", "content": "Three tests fail in test_io.py."}
USER2 = {"role": "user", "content": "Fix the first one."}

CONVERSATIONS = {
    "one_turn": [SYSTEM, USER1],
    "two_turns": [SYSTEM, USER1, ASSISTANT, USER2],
    "two_system": [SYSTEM, {"role": "developer", "content": "Be terse."}, USER1],
    # The first user text starts like the system text (Mistral-style templates put the system
    # text where this user text is, on multi-turn prompts).
    "like_system": [SYSTEM, {"role": "user", "content": "You are right, list them."}, ASSISTANT, USER2],
}


@pytest.mark.parametrize("a,b,n", [
    ([], [], 0), ([1], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2, 4], 2),
    ([5], [6], 0), (list(range(1000)), list(range(1000)) + [7], 1000),
    (list(range(1000)), list(range(600)) + [0] * 400, 600),
])
def test_common_prefix_len(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix_len(a, b) == n == common_prefix_len(b, a)


@pytest.mark.parametrize("a,b", [
    ([], []), ([1], []), ([1, 2, 3], [1, 2, 3]), ([1, 2, 3], [1, 2, 4]), ([5], [6]),
    ([256], [1]), ([1 << 24], [1]), (list(range(1000)), list(range(1000)) + [7]),
    (list(range(999)), list(range(600)) + [0] * 400), ([7] * 65, [7] * 64 + [8]),
])
def test_packed_prefix_len_agrees_with_list_version(a: list[int], b: list[int]) -> None:
    from prefix_cache.cache.boundary import packed_prefix_len
    from prefix_cache.cache.entry import pack_ids

    assert packed_prefix_len(pack_ids(a), pack_ids(b)) == common_prefix_len(a, b)


def test_probes_differ_in_their_first_character() -> None:
    assert PROBE_A[0] != PROBE_B[0]


def test_static_prefix_ids_is_the_common_prefix_of_two_renders() -> None:
    renders = {PROBE_A: [1, 2, 3, 10, 11], PROBE_B: [1, 2, 3, 20]}
    ids = static_prefix_ids(lambda conv: renders[conv[-1]["content"]], [SYSTEM])
    assert ids == [1, 2, 3]
    assert system_end([1, 2, 9], ids) == 2  # cut where the prompt leaves the scaffold


@pytest.mark.parametrize("n_tools", [0, 1, 4])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("behaviour", sorted(BEHAVIOURS))
def test_boundary_matches_references(qwen3, behaviour: str, conversation: str, n_tools: int) -> None:
    template = BEHAVIOURS[behaviour]
    messages = CONVERSATIONS[conversation]
    tools = make_tools(n_tools) or None
    cache = StaticPrefixCache()
    miss = cache.resolve(qwen3, messages, tools, chat_template=template)
    hit = cache.resolve(qwen3, messages, tools, chat_template=template)
    expected = reference.exact(qwen3, messages, tools, template=template)
    assert (miss.cache, hit.cache) == ("miss", "hit")
    assert miss.specprefill_system_end == hit.specprefill_system_end == expected
    assert miss.prompt_ids == hit.prompt_ids == reference.render(qwen3, messages, tools, None, template)
    text_at = reference.first_text_start(qwen3, messages, tools, template=template)
    assert expected == min(reference.multi_probe(qwen3, messages, tools, template=template), text_at)
    assert expected <= reference.first_user_text_index(qwen3, messages, tools, template=template)


def test_static_part_covers_tools_and_system(qwen3) -> None:
    """On a one-turn request the whole system + tools block is protected, up to the user text."""
    tools = make_tools(4)
    for behaviour in ("default_system", "tools_first", "developer_reasoning", "before_last_user",
                      "tools_in_first_user"):
        template = BEHAVIOURS[behaviour]
        r = StaticPrefixCache().resolve(qwen3, [SYSTEM, USER1], tools, chat_template=template)
        text = qwen3.decode(r.prompt_ids[: r.specprefill_system_end])
        assert "tool_0_3" in text, behaviour
        assert "Follow the repository rules" in text, behaviour
        assert r.specprefill_system_end == reference.first_user_text_index(
            qwen3, [SYSTEM, USER1], tools, template=template), behaviour


def test_mistral_style_stops_at_first_user_on_later_turns(qwen3) -> None:
    """System and tools move before the last user turn: nothing static precedes the first one."""
    template = BEHAVIOURS["before_last_user"]
    tools = make_tools(4)
    r = StaticPrefixCache().resolve(qwen3, CONVERSATIONS["two_turns"], tools, chat_template=template)
    text = qwen3.decode(r.prompt_ids[: r.specprefill_system_end])
    assert "tool_0" not in text and "Follow" not in text
    assert r.specprefill_system_end == reference.two_probe(
        qwen3, CONVERSATIONS["two_turns"], tools, template=template)
    # A first user text that starts like the system text does not pull the cut into it.
    like = CONVERSATIONS["like_system"]
    r = StaticPrefixCache().resolve(qwen3, like, chat_template=template)
    at = reference.first_user_text_index(qwen3, like, template=template)
    assert r.specprefill_system_end <= at < reference.two_probe(qwen3, like, template=template)
    assert r.specprefill_system_end <= reference.first_user_text_index(
        qwen3, CONVERSATIONS["two_turns"], tools, template=template)


@pytest.mark.parametrize("messages", [
    [USER1], [USER1, ASSISTANT, USER2], [SYSTEM], [SYSTEM, {"role": "developer", "content": "x"}],
    [USER1, SYSTEM, USER2],
])
def test_no_static_part_or_only_static_gives_zero(qwen3, messages) -> None:
    r = StaticPrefixCache().resolve(qwen3, messages, make_tools(2), chat_template=BEHAVIOURS["default_system"])
    assert (r.specprefill_system_end, r.cache, r.key, r.hit) == (0, "none", "", False)
    assert r.prompt_ids == reference.render(qwen3, messages, make_tools(2), None, BEHAVIOURS["default_system"])


def test_protect_default_prefix_covers_injected_system_block(qwen3) -> None:
    template = BEHAVIOURS["default_system"]
    tools = make_tools(3)
    cache = StaticPrefixCache(protect_default_prefix=True)
    first = cache.resolve(qwen3, [USER1], tools, chat_template=template)
    again = cache.resolve(qwen3, [USER1], tools, chat_template=template)
    expected = reference.multi_probe(qwen3, [USER1], tools, template=template, static=[])
    assert first.specprefill_system_end == again.specprefill_system_end == expected > 0
    assert (first.cache, again.cache) == ("miss", "hit")
    assert "Example Corp" in qwen3.decode(first.prompt_ids[:expected])
    # Off by default: the reference engines protect nothing without a system message.
    assert StaticPrefixCache().resolve(qwen3, [USER1], tools, chat_template=template).cache == "none"


def test_template_needing_tool_list_renders_without_tools(qwen3) -> None:
    template = BEHAVIOURS["needs_tool_list"]
    r = StaticPrefixCache().resolve(qwen3, [SYSTEM, USER1], None, chat_template=template)
    assert r.specprefill_system_end == reference.two_probe(qwen3, [SYSTEM, USER1], None, template=template) > 0


def test_template_error_is_typed_and_carries_the_template_message(qwen3) -> None:
    cache = StaticPrefixCache()
    with pytest.raises(TemplateRenderError, match="System role not supported"):
        cache.resolve(qwen3, [SYSTEM, USER1], chat_template=NO_SYSTEM_ROLE)
    assert len(cache.store) == 0  # a failed request caches nothing
    assert cache.stats.snapshot()["errors"] == 1


def test_reasoning_effort_kwarg_changes_the_static_part(qwen3) -> None:
    template = BEHAVIOURS["developer_reasoning"]
    cache = StaticPrefixCache()
    low = cache.resolve(qwen3, [SYSTEM, USER1], make_tools(2), {"reasoning_effort": "low"}, chat_template=template)
    high = cache.resolve(qwen3, [SYSTEM, USER1], make_tools(2), {"reasoning_effort": "high"}, chat_template=template)
    assert low.key != high.key and high.cache == "miss"
    assert "Reasoning: high" in qwen3.decode(high.prompt_ids[: high.specprefill_system_end])
    assert high.specprefill_system_end == reference.two_probe(
        qwen3, [SYSTEM, USER1], make_tools(2), {"reasoning_effort": "high"}, template=template)


def test_content_part_lists_in_static_and_user_messages(qwen3) -> None:
    template = BEHAVIOURS["content_parts"]
    system = {"role": "system", "content": [{"type": "text", "text": "You see images."}]}
    user = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                        {"type": "text", "text": "What is this?"}]}
    cache = StaticPrefixCache()
    r = cache.resolve(qwen3, [system, user], chat_template=template)
    assert r.specprefill_system_end == reference.two_probe(qwen3, [system, user], template=template) > 0
    other_user = {"role": "user", "content": [{"type": "text", "text": "And this?"}]}
    assert cache.resolve(qwen3, [system, other_user], chat_template=template).cache == "hit"

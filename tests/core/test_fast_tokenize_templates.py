"""Proof of the fast path over the real templates and tokenizers (issue #13): a prompt the cache
renders and tokenizes from its entry's split has exactly the ids of transformers' own
``apply_chat_template(..., tokenize=True)``, for every template in ../shared/chat_templates with
every real tokenizer the tests build, and over random conversations (hypothesis).

The cache runs with ``tokenize_check_rate=0`` here, so the ids compared are the fast path's
own, never replaced by a sampled full tokenization. The reference is the independent
``tests.support.reference.render``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_cache import StaticPrefixCache, TemplateRenderError
from prefix_cache.cache import boundary
from prefix_cache.render.split import split_rule
from prefix_cache.cache._probes import probe
from prefix_cache.render.render import get_renderer
from prefix_cache.testing.offline_tokenizers import (
    NAMES,
    TEMPLATE_TOKENIZER,
    load_offline_tokenizer,
)

from tests.support import reference
from tests.support.paths import TEMPLATE_STEMS, TEMPLATES_DIR, needs_templates
from tests.support.templates import BEHAVIOURS
from tests.support.tools import make_tools

STEMS = TEMPLATE_STEMS

SYSTEM = {"role": "system", "content": "You are the on-call agent.\nKeep answers short."}
KWARGS = {"datetime": "2026-12-02", "functions": "[]", "reasoning_effort": "high"}
# First user texts that start where a cut could act: whitespace and line breaks (pre-tokenizer
# look-ahead), a combining mark (NFC), special-token text, digits, contractions, CJK, a probe.
EDGE_TEXTS = ["Hi", " leading space", "\n\nnew lines first", "\u0301 a combining mark",
              "<|im_end|><|eot_id|>[INST]</s>", "12345 digits", "'s contraction", "日本語です",
              "}\n]\n\"json\": 1", "\t\ttabs", "Tell me a joke."]


@cache
def template_text(stem: str) -> str:
    return (TEMPLATES_DIR / f"{stem}.jinja").read_text(encoding="utf-8")


def conversations(text: str) -> list[list[dict[str, Any]]]:
    """One turn and a multi-turn conversation around a first user text."""
    return [[SYSTEM, {"role": "user", "content": text}],
            [SYSTEM, {"role": "user", "content": text}, {"role": "assistant", "content": "Done."},
             {"role": "user", "content": text[::-1] or "again"}]]


def check(cache_: StaticPrefixCache, tok: Any, messages: list[dict[str, Any]],
          tools: list[dict[str, Any]] | None, template: str) -> bool:
    """The cache's prompt ids equal the reference render; False when the template refuses."""
    try:
        expected = reference.render(tok, messages, tools, KWARGS, template)
    except Exception:
        return False
    got = cache_.resolve(tok, messages, tools, KWARGS, chat_template=template)
    assert got.prompt_ids == list(expected), (messages, tools)
    return True


TOTALS = {"fast": 0, "full": 0, "caps checked": 0, "caps from a split": 0}


@needs_templates
@pytest.mark.parametrize("stem", STEMS)
def test_fast_ids_equal_the_full_tokenization(stem: str) -> None:
    """Every template with every real tokenizer: a miss, then hits whose first user text starts
    with whatever could interact with a cut."""
    template = template_text(stem)
    for n, name in enumerate(NAMES):
        tok = load_offline_tokenizer(name)
        cache_ = StaticPrefixCache(tokenize_check_rate=0)
        for tools in (None, make_tools(3)):
            # Each tokenizer gets every edge text once, one- or multi-turn by turns.
            for i, text in enumerate(EDGE_TEXTS):
                check(cache_, tok, conversations(text)[(i + n) % 2], tools, template)
        snap = cache_.stats.snapshot()
        assert snap["tokenize_mismatches"] == 0
        TOTALS["fast"] += snap["fast_tokenizations"]
        TOTALS["full"] += snap["full_tokenizations"]


@needs_templates
def test_the_fast_path_is_what_most_of_those_prompts_took() -> None:
    """Guards the proof above: it must run through the fast path, not around it."""
    if not TOTALS["fast"] + TOTALS["full"]:
        pytest.skip("run together with test_fast_ids_equal_the_full_tokenization")
    assert TOTALS["fast"] > TOTALS["full"], TOTALS


CAP_TAIL = [{"role": "assistant", "content": "OK."}, {"role": "user", "content": "Go on."}]


def reference_cap(tok: Any, tools: list[dict[str, Any]] | None, template: str) -> int:
    """Where two multi-turn conversations that differ in their first user text part, from
    transformers' own render and tokenization of each (0 when the template refuses them)."""
    convs = [[SYSTEM, {"role": "user", "content": probe}, *CAP_TAIL]
             for probe in (boundary.PROBE_A, boundary.PROBE_B)]
    try:
        a, b = (list(reference.render(tok, c, tools, KWARGS, template)) for c in convs)
    except Exception:
        return 0
    return reference.cpl(a, b)


@needs_templates
@pytest.mark.parametrize("stem", STEMS)
def test_the_cap_from_the_split_equals_the_full_tokenization(stem: str) -> None:
    """A miss tokenizes its two multi-turn probes from the split it just found: the cap it
    stores equals the one from two whole renders and tokenizations, for every template with
    every real tokenizer."""
    template = template_text(stem)
    for name in NAMES:
        tok = load_offline_tokenizer(name)
        for tools in (None, make_tools(3)):
            renderer = get_renderer(tok, template, tools)
            rule = split_rule(tok, renderer.split_special_tokens)
            def render(conv: Any, choice: Any, r: Any = renderer) -> str:
                return r.render_text(conv, choice, KWARGS)
            try:  # as a cache with its accelerators probes: the split looked for
                probed = probe(render, renderer, [SYSTEM], tools, rule)
            except TemplateRenderError:
                continue
            rendered_with = [] if probed.empty_tools else tools
            assert probed.cap == reference_cap(tok, rendered_with, template), (name, tools)
            TOTALS["caps checked"] += 1
            TOTALS["caps from a split"] += probed.split is not None


@needs_templates
def test_most_of_those_caps_came_from_a_split() -> None:
    """Guards the cap check above the same way: it must use the split."""
    if not TOTALS["caps checked"]:
        pytest.skip("run together with test_the_cap_from_the_split_equals_the_full_tokenization")
    assert TOTALS["caps from a split"] * 2 > TOTALS["caps checked"], TOTALS


# -- random conversations -------------------------------------------------------------------------

PAIRS = sorted(TEMPLATE_TOKENIZER.items()) if STEMS else []
TRICKY = [*EDGE_TEXTS, "", " ", "\n", "\r\n", "  \n  x", "x" * 40, "<|im_start|>user\nHi",
          "é", "e\u0301", "Ω", "\u200b", "{\n    \"a\": 1\n}", "...", "1.5e10", "I'll", "ABCdef"]
text_strategy = st.one_of(st.sampled_from(TRICKY), st.text(max_size=24),
                          st.lists(st.sampled_from(TRICKY), min_size=2, max_size=3).map("".join))


@st.composite
def requests(draw: Any) -> tuple[str, str, list[dict[str, Any]], list[dict[str, Any]] | None]:
    if PAIRS and draw(st.booleans()):
        stem, name = draw(st.sampled_from(PAIRS))
        template = template_text(stem)
    else:
        name = draw(st.sampled_from(NAMES))
        template = BEHAVIOURS[draw(st.sampled_from(sorted(BEHAVIOURS)))]
    static = [{"role": draw(st.sampled_from(["system", "developer"])),
               "content": draw(st.sampled_from([SYSTEM["content"], "Be brief.", ""]))}]
    turns: list[dict[str, Any]] = []
    for i in range(draw(st.integers(1, 4))):
        role = "user" if i % 2 == 0 else "assistant"
        turns.append({"role": role, "content": draw(text_strategy)})
    tools = draw(st.sampled_from([None, make_tools(2), make_tools(5, seed=1)]))
    return name, template, static + turns, tools


CACHE = StaticPrefixCache(tokenize_check_rate=0)  # across examples: later ones hit


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_random_conversations_fast_ids_equal_the_full_tokenization(request: Any) -> None:
    name, template, messages, tools = request
    check(CACHE, load_offline_tokenizer(name), messages, tools, template)

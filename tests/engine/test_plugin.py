"""The plug-in for engines that compute specprefill_system_end themselves, against two small
engines in oMLX's shapes: a text engine (prompt is a string it prefills as
``tokenizer.encode(prompt)``, the tokenizer's defaults) and a vision-language engine (prompt is
token ids with image placeholders expanded; messages carry image parts)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine_adapter.plugin import SpecPrefillBoundary, install
from prefix_cache import StaticPrefixCache

from tests.support.tools import make_tools

IMAGE_TOKENS = 16  # what the processor expands one <|image_pad|> into (a 4x4 merged grid)

# Qwen2.5-VL's layout: a default system turn, tools inside the system turn, image parts as
# <|vision_start|><|image_pad|><|vision_end|>; plus a template variable read in the system turn.
VL_TEMPLATE = """\
{%- macro render(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}
{%- if part.type in ('image', 'image_url') -%}<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- render(messages[0].content) }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{%- if reasoning_effort is defined %}{{- '\\nReasoning: ' + reasoning_effort }}{%- endif %}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
{%- if not (message.role == 'system' and loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


class TextEngine:
    """oMLX's text engine shape: renders to a string, then asks for the boundary."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def _apply_chat_template(self, messages: list[dict[str, Any]], tools: Any,
                             chat_template_kwargs: dict[str, Any] | None) -> str:
        return self._tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True,
            **(chat_template_kwargs or {}))

    def _inject_specprefill_system_end(self, messages: list[dict[str, Any]], prompt: str,
                                       template_tools: Any, ct_kwargs: dict[str, Any] | None,
                                       kwargs: dict[str, Any]) -> None:
        """The engine's own: full prompt minus a render without the system messages."""
        non_system = [m for m in messages if m["role"] not in ("system", "developer")]
        rest = self._apply_chat_template(non_system, template_tools, ct_kwargs)
        end = len(self._tokenizer.encode(prompt)) - len(self._tokenizer.encode(rest))
        if end > 0:
            kwargs["specprefill_system_end"] = end

    def chat(self, messages: list[dict[str, Any]], tools: Any = None,
             **kwargs: Any) -> tuple[list[int], dict[str, Any]]:
        ct_kwargs = kwargs.pop("chat_template_kwargs", None)
        prompt = self._apply_chat_template(messages, tools, ct_kwargs)
        self._inject_specprefill_system_end(messages, prompt, tools, ct_kwargs, kwargs)
        return self._tokenizer.encode(prompt), kwargs  # oMLX: the tokenizer's defaults


class VisionLanguageEngine:
    """oMLX's vision-language engine shape: token ids with image placeholders expanded."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def _prepare_vision_inputs(self, messages: list[dict[str, Any]], tools: Any,
                               ct_kwargs: dict[str, Any] | None) -> list[int]:
        prompt = self._tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True,
            **(ct_kwargs or {}))
        ids: list[int] = []
        for t in self._tokenizer.encode(prompt, add_special_tokens=False):
            ids.extend([t] * IMAGE_TOKENS if t == self._image_pad else [t])
        return ids

    def _inject_specprefill_system_end(self, messages: list[dict[str, Any]],
                                       prompt: list[int], template_tools: Any,
                                       ct_kwargs: dict[str, Any] | None,
                                       kwargs: dict[str, Any]) -> None:
        """The upstream bug: the second render leaves out the tools and the template kwargs."""
        non_system = [m for m in messages if m["role"] not in ("system", "developer")]
        rest = self._prepare_vision_inputs(non_system, None, None)
        end = len(prompt) - len(rest)
        if end > 0:
            kwargs["specprefill_system_end"] = end

    def chat(self, messages: list[dict[str, Any]], tools: Any = None,
             **kwargs: Any) -> tuple[list[int], dict[str, Any]]:
        ct_kwargs = kwargs.pop("chat_template_kwargs", None)
        token_ids = self._prepare_vision_inputs(messages, tools, ct_kwargs)
        self._inject_specprefill_system_end(messages, token_ids, tools, ct_kwargs, kwargs)
        return token_ids, kwargs


def with_template(tokenizer: Any, template: str) -> Any:
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


@pytest.fixture
def vl_tokenizer(qwen3: Any) -> Any:
    return with_template(qwen3, VL_TEMPLATE)


@pytest.fixture
def text_tokenizer(qwen3: Any) -> Any:
    from prefix_cache.model_folders.demo import DEMO_TEMPLATE  # Qwen3's layout: tools in the system turn

    return with_template(qwen3, DEMO_TEMPLATE)


def image_turn(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "and this one"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,R0lGODlhAQAB"}},
    ]}


def user_turn_start(tok: Any, ids: list[int]) -> int:
    """Independent truth: the static prefix ends where the first user turn's text starts,
    right after its ``<|im_start|>user\n`` header (which every user turn shares)."""
    header = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    for i in range(len(ids)):
        if ids[i:i + len(header)] == header:
            return i + len(header)
    raise AssertionError("no user turn")


def last(boundary: SpecPrefillBoundary) -> Any:
    assert boundary.last is not None, "the boundary was never computed"
    return boundary.last


SYSTEM = {"role": "system", "content": "You are a vision agent. Use the tools to look at files."}
KWARGS = {"reasoning_effort": "high"}


def test_vision_language_boundary_renders_with_tools_and_kwargs(vl_tokenizer):
    engine = VisionLanguageEngine(vl_tokenizer)
    tools = make_tools(8)
    messages = [SYSTEM, image_turn("What is in these pictures?")]
    ids, buggy = engine.chat(messages, tools, chat_template_kwargs=KWARGS)
    truth = user_turn_start(vl_tokenizer, ids)
    static_text = vl_tokenizer.decode(ids[:truth])
    assert "tool_0_7" in static_text and "Reasoning: high" in static_text
    assert ids.count(vl_tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 2 * IMAGE_TOKENS
    # The upstream helper comes out a constant short: its second render gets the template's
    # default system turn (no tools, no kwargs) subtracted, and the user header is missed.
    default_turn = vl_tokenizer.encode("<|im_start|>system\nYou are a helpful assistant."
                                       "<|im_end|>\n<|im_start|>user\n")
    assert truth - buggy["specprefill_system_end"] == len(default_turn)

    boundary = SpecPrefillBoundary(StaticPrefixCache())
    install(engine, boundary)
    ids2, kwargs = engine.chat(messages, tools, chat_template_kwargs=KWARGS)
    assert ids2 == ids
    assert kwargs["specprefill_system_end"] == truth
    assert last(boundary).cache == "miss"


def test_engine_that_renders_with_empty_tools_gets_that_renders_boundary(qwen3):
    """tools=[] reaches the cache as []: the engine rendered with it, and a template that tests
    ``tools is not none`` renders a tool block for it that None would not."""
    from tests.support import reference
    from tests.support.templates import TOOLS_NOT_NONE

    tok = with_template(qwen3, TOOLS_NOT_NONE)
    engine = TextEngine(tok)
    boundary = SpecPrefillBoundary(StaticPrefixCache())
    install(engine, boundary)
    messages = [SYSTEM, {"role": "user", "content": "Which files changed?"}]
    ids, kwargs = engine.chat(messages, [])
    assert kwargs["specprefill_system_end"] == reference.two_probe(tok, messages, []) > 0
    assert "Environment: ipython" in tok.decode(ids[: kwargs["specprefill_system_end"]])


def test_vision_language_hits_on_the_next_turn_without_probe_renders(vl_tokenizer):
    engine = VisionLanguageEngine(vl_tokenizer)
    cache = StaticPrefixCache()
    install(engine, SpecPrefillBoundary(cache))
    tools = make_tools(4)
    first = [SYSTEM, image_turn("Describe them.")]
    engine.chat(first, tools, chat_template_kwargs=KWARGS)
    renders = cache.stats.snapshot()["renders"]
    second = first + [{"role": "assistant", "content": "Two cats."},
                      image_turn("And now, these two?")]
    ids, kwargs = engine.chat(second, tools, chat_template_kwargs=KWARGS)
    assert kwargs["specprefill_system_end"] == user_turn_start(vl_tokenizer, ids)
    stats = cache.stats.snapshot()
    assert stats["hits"] == 1 and stats["renders"] == renders


def test_vision_language_kwargs_change_the_boundary_they_render(vl_tokenizer):
    engine = VisionLanguageEngine(vl_tokenizer)
    install(engine, SpecPrefillBoundary(StaticPrefixCache()))
    messages = [SYSTEM, image_turn("Look.")]
    tools = make_tools(2)
    ids_low, low = engine.chat(messages, tools, chat_template_kwargs={"reasoning_effort": "low"})
    ids_none, none = engine.chat(messages, tools)
    assert low["specprefill_system_end"] == user_turn_start(vl_tokenizer, ids_low)
    assert none["specprefill_system_end"] == user_turn_start(vl_tokenizer, ids_none)
    assert low["specprefill_system_end"] > none["specprefill_system_end"]


def test_text_engine_boundary_covers_the_system_and_tools(text_tokenizer):
    qwen3 = text_tokenizer
    engine = TextEngine(qwen3)
    tools = make_tools(16)
    messages = [SYSTEM, {"role": "user", "content": "List the files."}]
    boundary = SpecPrefillBoundary(StaticPrefixCache())
    install(engine, boundary)
    ids, kwargs = engine.chat(messages, tools)
    truth = user_turn_start(qwen3, ids)
    assert kwargs["specprefill_system_end"] == truth
    assert "tool_0_15" in qwen3.decode(ids[:truth])
    assert last(boundary).prompt_ids == ids          # tokenized as the engine tokenizes


# Llama-3.x's layout: the template writes the BOS, and a Llama-3 tokenizer's defaults add another.
LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set sys = '' %}{%- set rest = messages %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + sys }}
{%- if tools %}{{- '\\n\\nTools:\\n' }}{%- for t in tools %}{{- (t | tojson) + '\\n' }}{%- endfor %}{%- endif %}
{{- '<|eot_id|>' }}
{%- for m in rest %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content or '') + '<|eot_id|>' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""


def first_user_text(tok: Any, ids: list[int], header: str) -> int:
    """Independent truth in the engine's own ids: where the first user turn's text starts."""
    head = tok.encode(header, add_special_tokens=False)
    return next(i + len(head) for i in range(len(ids)) if ids[i:i + len(head)] == head)


LLAMA3_USER = "<|start_header_id|>user<|end_header_id|>\n\n"


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_default_encode_is_the_engines_own(family, request):
    """oMLX prefills ``tokenizer.encode(prompt)``: on Llama-3 that is two BOS (the template's and
    the tokenizer's); the boundary lands on the user's text in those ids, turn after turn."""
    from prefix_cache.model_folders.demo import DEMO_TEMPLATE

    template, header = ((LLAMA3_TEMPLATE, LLAMA3_USER) if family == "llama3"
                        else (DEMO_TEMPLATE, "<|im_start|>user\n"))
    tok = with_template(request.getfixturevalue(family), template)
    engine = TextEngine(tok)
    boundary = SpecPrefillBoundary(StaticPrefixCache())
    install(engine, boundary)
    tools = make_tools(8)
    first = [SYSTEM, {"role": "user", "content": "List the files."}]
    second = first + [{"role": "assistant", "content": "a.txt"},
                      {"role": "user", "content": "And the dirs?"}]
    for messages, cache in ((first, "miss"), (second, "hit")):
        ids, kwargs = engine.chat(messages, tools)
        end = kwargs["specprefill_system_end"]
        assert end == first_user_text(tok, ids, header)
        assert tok.decode(ids[end:]).startswith("List the files.")
        assert last(boundary).cache == cache
    doubled = ids[:2] == [tok.bos_token_id] * 2
    assert doubled == (family == "llama3")           # the case the old default got one short


def test_given_encode_counts_in_its_own_ids(llama3):
    """An engine that prefills without the tokenizer's specials passes its encode: the boundary
    counts in those ids."""
    tok = with_template(llama3, LLAMA3_TEMPLATE)
    messages = [SYSTEM, {"role": "user", "content": "List the files."}]
    tools = make_tools(4)
    prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                     add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    boundary = SpecPrefillBoundary(StaticPrefixCache(), tokenizer=tok,
                                   encode=lambda p: tok.encode(p, add_special_tokens=False))
    kwargs: dict[str, Any] = {}
    boundary(messages, prompt, tools, None, kwargs)
    assert kwargs["specprefill_system_end"] == first_user_text(tok, ids, LLAMA3_USER)
    default: dict[str, Any] = {}
    asyncio.run(SpecPrefillBoundary(StaticPrefixCache(), tokenizer=tok).ainject(
        messages, prompt, tools, None, default))
    assert default["specprefill_system_end"] == kwargs["specprefill_system_end"] + 1


def test_text_engine_own_subtraction_is_what_the_plugin_replaces(text_tokenizer):
    qwen3 = text_tokenizer
    engine = TextEngine(qwen3)
    tools = make_tools(16)
    messages = [SYSTEM, {"role": "user", "content": "List the files."}]
    ids, own = engine.chat(messages, tools)
    # Tools stay in the second render, so the subtraction only counts the system text.
    assert own["specprefill_system_end"] < user_turn_start(qwen3, ids) - 500


def test_namespaces_get_their_own_entries(vl_tokenizer):
    engine = VisionLanguageEngine(vl_tokenizer)
    cache = StaticPrefixCache()
    install(engine, SpecPrefillBoundary(cache, namespace=lambda kw: kw.get("tenant", "default")))
    messages = [SYSTEM, image_turn("Hi.")]
    _, a = engine.chat(messages, make_tools(2), tenant="a")
    _, b = engine.chat(messages, make_tools(2), tenant="b")
    assert a["specprefill_system_end"] == b["specprefill_system_end"] > 0
    assert cache.stats.snapshot()["misses"] == 2 and cache.stats.snapshot()["hits"] == 0


def test_off_given_or_failing_requests_keep_their_kwargs(vl_tokenizer):
    engine = VisionLanguageEngine(vl_tokenizer)
    boundary = SpecPrefillBoundary(StaticPrefixCache())
    install(engine, boundary)
    messages = [SYSTEM, image_turn("Hi.")]
    _, off = engine.chat(messages, specprefill=False)
    assert "specprefill_system_end" not in off
    _, given = engine.chat(messages, specprefill_system_end=7)
    assert given["specprefill_system_end"] == 7             # a sidecar in front already sent it
    bad = [SYSTEM, {"role": "narrator", "content": "?"}]
    kwargs: dict[str, Any] = {}
    boundary(bad, [1, 2, 3], None, None, kwargs, tokenizer=vl_tokenizer)  # a render that fails
    assert kwargs == {} and boundary.last is None           # no boundary, no exception
    for bad_tools in ([1, 2], "tools"):                     # not tool objects: no copy made
        boundary(messages, [1, 2, 3], bad_tools, None, kwargs, tokenizer=vl_tokenizer)
        asyncio.run(boundary.ainject(messages, [1, 2, 3], bad_tools, None, kwargs,
                                     tokenizer=vl_tokenizer))
    assert kwargs == {} and boundary.last is None


def test_no_static_part_sets_no_boundary(vl_tokenizer):
    engine = VisionLanguageEngine(vl_tokenizer)
    boundary = SpecPrefillBoundary(StaticPrefixCache())
    install(engine, boundary)
    _, kwargs = engine.chat([image_turn("Hi.")], make_tools(2))
    assert "specprefill_system_end" not in kwargs and last(boundary).cache == "none"


def test_async_injection_gives_the_same_boundary(vl_tokenizer):
    engine = VisionLanguageEngine(vl_tokenizer)
    tools = make_tools(4)
    messages = [SYSTEM, image_turn("Async?")]
    ids, _ = engine.chat(messages, tools, chat_template_kwargs=KWARGS)  # its own boundary
    boundary = SpecPrefillBoundary(StaticPrefixCache(), tokenizer=vl_tokenizer)
    kwargs: dict[str, Any] = {}
    asyncio.run(boundary.ainject(messages, ids, tools, KWARGS, kwargs))
    assert kwargs["specprefill_system_end"] == user_turn_start(vl_tokenizer, ids)


def test_the_core_and_the_plugin_import_without_mlx():
    import subprocess
    import sys

    code = ("import sys, prefix_cache, engine_adapter, engine_adapter.plugin; "
            "assert engine_adapter.SpecPrefillBoundary; "
            "bad = sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm'))); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

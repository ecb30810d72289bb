"""Conformance over the real chat templates in ../shared/chat_templates (skipped when absent).

Each template is run through the CLI, as a user would, with its fitting real tokenizer, and
through an mlx-lm TokenizerWrapper over that tokenizer, as an mlx-lm engine renders. Every answer
must equal the reference (the two-probe answer, never past the first non-static text) and a
brute-force multi-probe reference, must never be past the first user text, and a repeated
static part must be a hit with the same answer. Requests include tools=[] (not None) and
multi-turn prompts whose first user text starts like the system text or like the probes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prefix_cache import PrefixCacheError, StaticPrefixCache, cli
from prefix_cache.testing.offline_tokenizers import (
    TEMPLATE_TOKENIZER,
    load_offline_tokenizer,
    make_model_dir,
)

from tests.support import reference
from tests.support.paths import TEMPLATE_STEMS, TEMPLATES_DIR, needs_templates
from tests.support.tools import make_tools

STEMS = TEMPLATE_STEMS

pytestmark = needs_templates

SYSTEM = {"role": "system", "content": "You are the on-call agent for the payments team."}
DEVELOPER = {"role": "developer", "content": "Answer in one paragraph."}
U1 = {"role": "user", "content": "Why did the nightly job fail?"}
A1 = {"role": "assistant", "content": "The database migration timed out."}
U2 = {"role": "user", "content": "Retry it with a longer timeout."}
# First user texts that share their leading word with the system text or with a probe.
LIKE_SYSTEM = {"role": "user", "content": "You are right, the nightly job failed again."}
LIKE_PROBE_A = {"role": "user", "content": "Hi, why did the nightly job fail?"}
LIKE_PROBE_B = {"role": "user", "content": "Tell me why the nightly job failed."}
# firefunction-v2 reads `datetime` and `functions` from the template variables.
KWARGS = {"datetime": "2026-12-02", "functions": "[]"}


def requests_for(stem: str) -> list[dict[str, Any]]:
    kwargs = dict(KWARGS)
    if "gpt-oss" in stem or "Solar" in stem:
        kwargs["reasoning_effort"] = "high"
    cases = []
    for messages in ([SYSTEM, U1], [SYSTEM, U1, A1, U2], [SYSTEM, DEVELOPER, U1], [DEVELOPER, U1], [U1],
                     [SYSTEM, LIKE_SYSTEM, A1, U2], [SYSTEM, LIKE_PROBE_A, A1, U2],
                     [SYSTEM, LIKE_PROBE_B, A1, U2]):
        for n_tools in (0, 4):
            cases.append({"messages": messages, "tools": make_tools(n_tools) or None,
                          "chat_template_kwargs": kwargs})
    for messages in ([SYSTEM, U1], [SYSTEM, LIKE_SYSTEM, A1, U2]):
        cases.append({"messages": messages, "tools": [], "chat_template_kwargs": kwargs})
    return cases


def _reference(tok: Any, template: str | None, req: dict[str, Any]) -> tuple[int, int, int] | None:
    args = (tok, req["messages"], req["tools"], req["chat_template_kwargs"])
    try:
        expected = reference.exact(*args, template=template)
        static = reference.leading_static(req["messages"])
        if static and len(static) < len(req["messages"]):
            text_at = reference.first_text_start(*args, template=template)
            brute = min(reference.multi_probe(*args, template=template), text_at)
        else:
            brute = 0
        user_at = reference.first_user_text_index(*args, template=template)
    except Exception:
        return None  # the template itself fails on this request
    return expected, brute, user_at


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conformance")
    return {name: make_model_dir(root / name, name, None) for name in set(TEMPLATE_TOKENIZER.values())}


RENDERED: set[str] = set()


@pytest.mark.parametrize("stem", STEMS)
def test_template(stem: str, model_dirs, tmp_path, capsysbinary) -> None:
    tok_name = TEMPLATE_TOKENIZER[stem]
    template_file = TEMPLATES_DIR / f"{stem}.jinja"
    template = template_file.read_text(encoding="utf-8")
    reqs = requests_for(stem)
    path = tmp_path / "requests.jsonl"
    # Each request twice: the second must be a hit (or none) with the same answer.
    path.write_text("".join(json.dumps(r) + "\n" + json.dumps(r) + "\n" for r in reqs))
    code = cli.main(["boundary", "--model", str(model_dirs[tok_name]), "--chat-template",
                     str(template_file), "--requests", str(path)])
    lines = [json.loads(line) for line in capsysbinary.readouterr().out.decode().splitlines()]
    assert len(lines) == 2 * len(reqs)
    tok = load_offline_tokenizer(tok_name)
    rendered = 0
    seen: set[str] = set()
    for i, req in enumerate(reqs):
        first, second = lines[2 * i], lines[2 * i + 1]
        ref = _reference(tok, template, req)
        if ref is None:
            assert "error" in first and "error" in second, (stem, i, first)
            continue
        rendered += 1
        expected, brute, user_at = ref
        assert "error" not in first, (stem, i, first)
        assert first["specprefill_system_end"] == expected == brute, (stem, i, first, ref)
        assert first["specprefill_system_end"] <= user_at, (stem, i, first, ref)
        assert second["specprefill_system_end"] == first["specprefill_system_end"]
        assert second["prompt_tokens"] == first["prompt_tokens"]
        if req["messages"][0]["role"] in ("system", "developer"):
            # A static part seen before (same system, tools, kwargs) is already a hit.
            assert first["cache"] == ("hit" if first["key"] in seen else "miss"), (stem, i, first)
            assert second["cache"] == "hit" and second["key"] == first["key"], (stem, i, second)
            seen.add(first["key"])
        else:
            assert first["cache"] == second["cache"] == "none", (stem, i, first)
    assert code == (0 if rendered == len(reqs) else 2)
    if rendered:
        RENDERED.add(stem)


WRAPPED_CASES = ([SYSTEM, U1], [SYSTEM, LIKE_SYSTEM, A1, U2])


@pytest.mark.parametrize("stem", STEMS)
def test_template_through_a_tokenizer_wrapper(stem: str) -> None:
    """An mlx-lm engine renders through its TokenizerWrapper (which sets enable_thinking from
    the vocabulary): the answer is the reference over the wrapper's own render."""
    tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")
    template = (TEMPLATES_DIR / f"{stem}.jinja").read_text(encoding="utf-8")
    wrapper = tokenizer_utils.TokenizerWrapper(load_offline_tokenizer(TEMPLATE_TOKENIZER[stem]))
    cache = StaticPrefixCache()
    for messages in WRAPPED_CASES:
        for tools in (None, make_tools(4)):
            req = {"messages": messages, "tools": tools, "chat_template_kwargs": requests_for(stem)[0][
                "chat_template_kwargs"]}
            ref = _reference(wrapper, template, req)
            if ref is None:
                with pytest.raises(PrefixCacheError):
                    cache.resolve(wrapper, messages, tools, req["chat_template_kwargs"],
                                  chat_template=template)
                continue
            expected, brute, user_at = ref
            engine_ids = reference.render(wrapper, messages, tools, req["chat_template_kwargs"], template)
            for _ in range(2):  # a miss, then a hit
                r = cache.resolve(wrapper, messages, tools, req["chat_template_kwargs"],
                                  prompt_ids=engine_ids, chat_template=template)
                assert r.specprefill_system_end == expected == brute, (stem, messages, tools, r, ref)
                assert r.specprefill_system_end <= user_at
            assert r.hit


def test_most_templates_render() -> None:
    """Guards the suite itself: it must exercise the real templates, not skip past them."""
    if len(RENDERED) == 0:
        pytest.skip("run together with test_template")
    assert len(RENDERED) >= 50, sorted(set(STEMS) - RENDERED)

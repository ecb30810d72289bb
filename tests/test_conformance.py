"""Conformance over the real chat templates in ../shared/chat_templates (skipped when absent).

Each template is run through the CLI, as a user would, with its fitting real tokenizer. Every
answer must equal the two-probe reference and a brute-force multi-probe reference, must never
be past the first user text, and a repeated static part must be a hit with the same answer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from prefix_cache import cli
from prefix_cache.testing.offline_tokenizers import (
    TEMPLATE_TOKENIZER,
    load_offline_tokenizer,
    make_model_dir,
)

from . import reference
from .conftest import SHARED_TEMPLATES, make_tools

TEMPLATES_DIR = Path(os.environ.get("PREFIX_CACHE_TEMPLATES", SHARED_TEMPLATES))
STEMS = sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja")) if TEMPLATES_DIR.is_dir() else []

pytestmark = pytest.mark.skipif(not STEMS, reason=f"no chat templates at {TEMPLATES_DIR}")

SYSTEM = {"role": "system", "content": "You are the on-call agent for the payments team."}
DEVELOPER = {"role": "developer", "content": "Answer in one paragraph."}
U1 = {"role": "user", "content": "Why did the nightly job fail?"}
A1 = {"role": "assistant", "content": "The database migration timed out."}
U2 = {"role": "user", "content": "Retry it with a longer timeout."}
# firefunction-v2 reads `datetime` and `functions` from the template variables.
KWARGS = {"datetime": "2026-12-02", "functions": "[]"}


def requests_for(stem: str) -> list[dict[str, Any]]:
    kwargs = dict(KWARGS)
    if "gpt-oss" in stem or "Solar" in stem:
        kwargs["reasoning_effort"] = "high"
    cases = []
    for messages in ([SYSTEM, U1], [SYSTEM, U1, A1, U2], [SYSTEM, DEVELOPER, U1], [DEVELOPER, U1], [U1]):
        for n_tools in (0, 4):
            cases.append({"messages": messages, "tools": make_tools(n_tools) or None,
                          "chat_template_kwargs": kwargs})
    return cases


def _reference(tok: Any, template: str, req: dict[str, Any]) -> tuple[int, int, int] | None:
    args = (tok, req["messages"], req["tools"], req["chat_template_kwargs"])
    try:
        expected = reference.two_probe(*args, template=template)
        static = reference.leading_static(req["messages"])
        brute = reference.multi_probe(*args, template=template) if static else 0
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


def test_most_templates_render() -> None:
    """Guards the suite itself: it must exercise the real templates, not skip past them."""
    if len(RENDERED) == 0:
        pytest.skip("run together with test_template")
    assert len(RENDERED) >= 50, sorted(set(STEMS) - RENDERED)

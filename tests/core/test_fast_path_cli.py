"""``prefix-cache boundary`` prints byte-for-byte the same lines with ``PREFIX_CACHE_FAST_PATH``
on and off: over the examples, and over the conformance templates (skipped when absent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefix_cache import cli
from prefix_cache.fastpath import FAST_PATH_ENV
from prefix_cache.testing.offline_tokenizers import TEMPLATE_TOKENIZER, make_model_dir
from tests.core.test_conformance import requests_for
from tests.support.paths import TEMPLATE_STEMS, TEMPLATES_DIR, needs_templates
from tests.support.templates import BEHAVIOURS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _both(args: list[str], monkeypatch, capsysbinary) -> tuple[bytes, bytes]:
    """stdout of one run with the fast path on and one with it off (each a fresh cache)."""
    out = {}
    for value in ("on", "off"):
        monkeypatch.setenv(FAST_PATH_ENV, value)
        code = cli.main(args)
        out[value] = (code, capsysbinary.readouterr().out)
    assert out["on"][0] == out["off"][0]  # 2 on both when a request fails
    return out["on"][1], out["off"][1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fast-path-models")
    return {name: make_model_dir(root / name, name, BEHAVIOURS[behaviour])
            for name, behaviour in (("qwen3", "default_system"),
                                    ("llama3.1", "tools_in_first_user"))}


@pytest.mark.parametrize("example", ["request.json", "agent_turns.jsonl"])
@pytest.mark.parametrize("tokenizer", ["qwen3", "llama3.1"])
def test_examples(example, tokenizer, model_dirs, monkeypatch, capsysbinary) -> None:
    flag = "--request" if example.endswith(".json") else "--requests"
    on, off = _both(["boundary", "--model", str(model_dirs[tokenizer]), flag,
                     str(EXAMPLES / example)], monkeypatch, capsysbinary)
    assert on == off
    assert on.count(b"\n") >= 1 and b'"error"' not in on


@pytest.fixture(scope="module")
def template_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fast-path-conformance")
    return {name: make_model_dir(root / name, name, None)
            for name in set(TEMPLATE_TOKENIZER.values())}


@needs_templates
@pytest.mark.parametrize("stem", TEMPLATE_STEMS)
def test_conformance_templates(stem, template_dirs, tmp_path, monkeypatch, capsysbinary) -> None:
    requests = tmp_path / "requests.jsonl"
    # Each request twice: misses and hits both compared.
    requests.write_text("".join(json.dumps(r) + "\n" + json.dumps(r) + "\n"
                                for r in requests_for(stem)))
    on, off = _both(["boundary", "--model", str(template_dirs[TEMPLATE_TOKENIZER[stem]]),
                     "--chat-template", str(TEMPLATES_DIR / f"{stem}.jinja"),
                     "--requests", str(requests)], monkeypatch, capsysbinary)
    assert on == off

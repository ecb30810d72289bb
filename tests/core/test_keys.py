"""Keys: every input that can change the render changes the key; nothing else does."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from prefix_cache import InvalidRequestError, StaticPrefixCache
from prefix_cache.cache import keys
from prefix_cache.cache._plan import make_plan
from prefix_cache.cache.keys import KeyPacker
from prefix_cache.render.render import get_renderer
from prefix_cache.render.tokenizer_identity import tokenizer_fingerprint

from tests.support.templates import BEHAVIOURS
from tests.support.tools import make_tools

TEMPLATE = BEHAVIOURS["default_system"]

BASE: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "hello"},
    ],
    "tools": make_tools(2),
    "kwargs": {"enable_thinking": False},
}

Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Edit:
    def edit(req: dict[str, Any]) -> None:
        target: Any = req
        parts = path.split(".")
        for part in parts[:-1]:
            target = target[int(part)] if part.isdigit() else target[part]
        last = parts[-1]
        target[int(last) if last.isdigit() else last] = value
    return edit


def _reorder_tool_keys(req: dict[str, Any]) -> None:
    fn = req["tools"][0]["function"]
    req["tools"][0]["function"] = dict(reversed(list(fn.items())))


CHANGES_KEY: dict[str, Edit] = {
    "system content": _set("messages.0.content", "You are a careless agent."),
    "system whitespace": _set("messages.0.content", "You are a careful agent. "),
    "system role -> developer": _set("messages.0.role", "developer"),
    "system name field": _set("messages.0.name", "ops"),
    "unknown field": _set("messages.0.cache_control", {"type": "ephemeral"}),
    "content parts": _set("messages.0.content", [{"type": "text", "text": "You are a careful agent."}]),
    "second static message": lambda r: r["messages"].insert(1, {"role": "developer", "content": "x"}),
    "tool order": lambda r: r["tools"].reverse(),
    "tool key order": _reorder_tool_keys,
    "tool description": _set("tools.1.function.description", "other"),
    "one tool fewer": lambda r: r["tools"].pop(),
    "no tools": _set("tools", None),
    "tools emptied": _set("tools", []),
    "kwarg value": _set("kwargs.enable_thinking", True),
    "kwarg added": _set("kwargs.reasoning_effort", "low"),
    "kwargs removed": _set("kwargs", None),
    "int vs float": _set("tools.0.function.parameters.properties.limit.default", 20.0),
    "true vs 1": _set("kwargs.enable_thinking", 1),
    "nan vs null": _set("tools.0.function.parameters.properties.limit.default", float("nan")),
}

KEEPS_KEY: dict[str, Edit] = {
    "user text": _set("messages.1.content", "a different question"),
    "later turns": lambda r: r["messages"].extend([
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]),
}


def _key(cache: StaticPrefixCache, tok: Any, req: dict[str, Any], **kw: Any) -> str:
    """The key ``cache`` would use (its plan: no render)."""
    return make_plan(tok, req["messages"], req["tools"], req["kwargs"],
                     kw.get("template", TEMPLATE), kw.get("namespace", "default"), None,
                     prefix=cache.prefix, protect_default_prefix=False,
                     renderers=cache._renderers, packer=KeyPacker()).key


@pytest.mark.parametrize("name", sorted(CHANGES_KEY))
def test_change_changes_key(qwen3, name: str) -> None:
    cache = StaticPrefixCache()
    req = copy.deepcopy(BASE)
    CHANGES_KEY[name](req)
    assert _key(cache, qwen3, req) != _key(cache, qwen3, BASE)


@pytest.mark.parametrize("name", sorted(KEEPS_KEY))
def test_irrelevant_change_keeps_key(qwen3, name: str) -> None:
    cache = StaticPrefixCache()
    req = copy.deepcopy(BASE)
    KEEPS_KEY[name](req)
    assert _key(cache, qwen3, req) == _key(cache, qwen3, BASE)


def test_empty_tools_and_no_tools_key_apart(qwen3) -> None:
    cache = StaticPrefixCache()
    assert _key(cache, qwen3, {**BASE, "tools": []}) != _key(cache, qwen3, {**BASE, "tools": None})


def test_namespace_template_and_tokenizer_change_key(qwen3, llama3) -> None:
    cache = StaticPrefixCache()
    base = _key(cache, qwen3, BASE)
    assert _key(cache, qwen3, BASE, namespace="tenant-b") != base
    assert _key(cache, qwen3, BASE, template=TEMPLATE + " ") != base
    assert _key(cache, llama3, BASE).split(":")[-1] != base.split(":")[-1]


def test_key_format_is_namespaced_in_the_clear(qwen3) -> None:
    key = _key(StaticPrefixCache(prefix="acme"), qwen3, BASE, namespace="tenant-7")
    prefix, namespace, model, digest = key.split(":")
    assert (prefix, namespace) == ("acme", "tenant-7")
    assert model.startswith("qwen3")
    assert re.fullmatch(r"[0-9a-f]{32}", digest)


@pytest.mark.parametrize("bad", ["", "a:b", "a*", "ten ant", "x" * 129, "-lead", "acme\n"])
def test_bad_namespace_is_refused(qwen3, bad: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        StaticPrefixCache().resolve(qwen3, BASE["messages"], namespace=bad, chat_template=TEMPLATE)


@pytest.mark.parametrize("bad", ["acme\n", "acme\r\n", "\nacme", "ac\nme", "acme\x00"])
def test_a_label_is_whole_line_free(bad: str) -> None:
    # With "$", a trailing newline passed and reached keys and purge patterns.
    with pytest.raises(ValueError, match="tenant"):
        keys.validate_label(bad, "tenant")
    assert keys.validate_label("acme-2.prod_x", "tenant") == "acme-2.prod_x"


def test_date_is_in_key_only_for_templates_that_read_it(qwen3, monkeypatch) -> None:
    dated = get_renderer(qwen3, BEHAVIOURS["todays_date"])
    plain = get_renderer(qwen3, TEMPLATE)
    assert dated.uses_date and not plain.uses_date
    # The tag is what the template's own strftime_now format prints (here a day).
    assert plain.date_tag() is None and re.fullmatch(r"\d{2} \w{3} \d{4}", dated.date_tag() or "")


def test_material_fields_cannot_run_into_each_other() -> None:
    a = keys.key_material(namespace="ab", identity=b"c", static=[], tools=None, kwargs=None)
    b = keys.key_material(namespace="a", identity=b"bc", static=[], tools=None, kwargs=None)
    assert keys.key_hash(a) != keys.key_hash(b)


def test_check_value_is_independent_of_key_hash() -> None:
    material = keys.key_material(namespace="n", identity=b"i", static=[{"role": "system"}],
                                 tools=None, kwargs=None)
    assert keys.check_value(material) != int(keys.key_hash(material)[:16], 16)


def test_non_json_input_is_a_clear_error(qwen3) -> None:
    messages = [{"role": "system", "content": "x", "extra": object()}, {"role": "user", "content": "y"}]
    with pytest.raises(InvalidRequestError, match="plain JSON"):
        _key(StaticPrefixCache(), qwen3, {"messages": messages, "tools": None, "kwargs": None})


def test_fingerprint_is_stable_across_processes(qwen3) -> None:
    """Replicas on other machines must compute the same key: no per-process randomness."""
    code = (
        "from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer;"
        "from prefix_cache.render.tokenizer_identity import tokenizer_fingerprint;"
        "print(tokenizer_fingerprint(load_offline_tokenizer('qwen3')).hex())"
    )
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])  # this tree's package
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=repo, env={"PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1",
                              "PATH": "/usr/bin:/bin", "HOME": str(__import__("pathlib").Path.home())})
    assert out.stdout.strip() == tokenizer_fingerprint(qwen3).hex()


def test_fingerprint_is_computed_once_per_tokenizer(qwen3, monkeypatch) -> None:
    import prefix_cache.render.tokenizer_identity as identity

    get_renderer(qwen3, TEMPLATE)
    calls = []
    monkeypatch.setattr(identity, "tokenizer_fingerprint", lambda t: calls.append(t) or b"x")
    for _ in range(3):
        get_renderer(qwen3, TEMPLATE)
    assert calls == []

"""Prefix-aware tokenization (issue #13): the safe-split rule, the run-time check and its off
switch, and the fast path everywhere a prompt is prepared (resolve, aresolve, the CLI, the
sidecar). Real tokenizers throughout; variants are fresh copies with added-token flags or settings
changed before first use.

The proof over every real template and tokenizer is tests/core/test_fast_tokenize_templates.py.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from prefix_cache import MemoryStore, StaticPrefixCache, cli
from prefix_cache.cache import prompt_tokens
from prefix_cache.cache.entry import decode_entry, encode_entry
from prefix_cache.cache._result import RenderedText
from prefix_cache.cache.keys import KeyPacker
from prefix_cache.cache.prompt_tokens import PromptTokenizer
from prefix_cache.fastpath import FastPromptText, FastPromptTokenizer
from prefix_cache.fastpath import _fast_tokenize
from prefix_cache.metrics import Metrics
from prefix_cache.cache.observer import CacheObserver
from prefix_cache.cache._plan import make_plan
from prefix_cache.render.render import Renderers, get_renderer
from prefix_cache.render.split import SplitRule, StaticSplit, split_rule
from prefix_cache.cache._stats import CacheStats
from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer, make_model_dir
from tests.support import reference
from tests.support.templates import BEFORE_LAST_USER, DEFAULT_SYSTEM, TOOLS_IN_FIRST_USER
from tests.support.tokenizers import fresh
from tests.support.tools import make_tools

SYSTEM = {"role": "system", "content": "You are the release agent.\nKeep the changelog."}
USER_TEXTS = ["Ship it.", "  two leading spaces", "\n\nline breaks first", "\u0301 combining",
              "<|im_end|> in the text", "'ll", "Hi"]


def conv(text: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": text}]


def with_flags(tok: Any, flags: dict[str, dict[str, bool]]) -> Any:
    """A fresh copy whose added tokens (by content) have the given flags."""
    from tokenizers import AddedToken

    out = fresh(tok)
    for content, values in flags.items():
        current = out.added_tokens_decoder[out.convert_tokens_to_ids(content)]
        settings = {name: getattr(current, name) for name in
                    ("lstrip", "rstrip", "single_word", "normalized", "special")}
        out.backend_tokenizer.add_tokens([AddedToken(content, **{**settings, **values})])
    return out


def rule_of(tok: Any) -> SplitRule:
    return split_rule(tok)


def cut_contents(rule: SplitRule, text: str) -> list[str]:
    """The text each candidate cut ends with (the last 12 characters)."""
    return [text[:stop][-12:] for _, stop in rule.candidates(text, len(text))]


def assert_exact(cache: StaticPrefixCache, tok: Any, template: str,
                 tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every user text: the cache's ids are the reference render's; the stats."""
    for text in USER_TEXTS:
        expected = reference.render(tok, conv(text), tools, None, template)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert cache.resolve(tok, conv(text), tools, chat_template=template).prompt_ids == expected
    return cache.stats.snapshot()


# -- the rule ---------------------------------------------------------------------------------


def test_special_split_ends_after_the_last_safe_added_token(qwen3) -> None:
    text = reference.render(qwen3, conv("Hi"), None, None, DEFAULT_SYSTEM, tokenize=False)
    cut = text.index("Hi")
    cuts = cut_contents(rule_of(qwen3), text[:cut])
    assert cuts[0].endswith("<|im_start|>")  # the user turn's own marker: a short tail
    cache = StaticPrefixCache(tokenize_check_rate=0)
    snap = assert_exact(cache, qwen3, DEFAULT_SYSTEM)
    assert snap["fast_tokenizations"] == len(USER_TEXTS) and snap["full_tokenizations"] == 0


def test_added_tokens_that_look_past_the_cut_never_end_a_split(qwen3) -> None:
    """rstrip takes the whitespace after the token, single_word looks at the next character,
    a normalized token is matched after the normalizer ran across its piece; lstrip takes
    whitespace only from inside the static text, so it may end a split."""
    tok = with_flags(qwen3, {"<|im_end|>": {"rstrip": True}, "<tool_call>": {"single_word": True},
                             "<think>": {"normalized": True}, "<|im_start|>": {"lstrip": True}})
    rule = rule_of(tok)
    for content, ends in (("<|im_end|>", False), ("<tool_call>", False), ("<think>", False),
                          ("<|im_start|>", True), ("<|endoftext|>", True)):
        assert bool(cut_contents(rule, "ab " + content)) == ends, content
    snap = assert_exact(StaticPrefixCache(tokenize_check_rate=0), tok, DEFAULT_SYSTEM)
    assert snap["fast_tokenizations"] == len(USER_TEXTS)


def test_no_cut_where_an_added_token_could_start_before_it_and_end_after(qwen3) -> None:
    """A token ">\\nuser" could start inside "<|im_end|>\\n<|im_start|>" ... no: it starts on the
    ">" that ends "<|im_start|>", so no cut there; and a longer token starting with a marker
    makes that marker unable to end a split."""
    from tokenizers import AddedToken

    tok = fresh(qwen3)
    tok.add_tokens([AddedToken(">user", normalized=False),
                    AddedToken("<|im_end|>!", normalized=False)])
    rule = rule_of(tok)
    text = reference.render(tok, conv("Hi"), None, None, DEFAULT_SYSTEM, tokenize=False)
    ends = cut_contents(rule, text[: text.index("Hi")])
    assert not any(e.endswith("<|im_start|>") or e.endswith("<|im_end|>") for e in ends)
    assert rule.crosses("a<|im_start|>", len("a<|im_start|>"))
    assert_exact(StaticPrefixCache(tokenize_check_rate=0), tok, DEFAULT_SYSTEM)


def test_split_special_tokens_makes_special_tokens_plain_text(qwen3) -> None:
    tok = fresh(qwen3)
    tok.split_special_tokens = True
    text = reference.render(tok, conv("Hi"), None, None, DEFAULT_SYSTEM, tokenize=False)
    assert not any(c.endswith("<|im_start|>") for c in cut_contents(rule_of(tok), text))
    assert_exact(StaticPrefixCache(tokenize_check_rate=0), tok, DEFAULT_SYSTEM)


def test_metaspace_first_is_why_the_tail_is_tokenized_from_the_token(qwen3) -> None:
    """SentencePiece-converted tokenizers prepend "▁" to the first piece of a text only: the
    text after a marker tokenizes differently on its own, so the tail keeps the marker."""
    spm = load_offline_tokenizer("spm-v7")
    alone = spm("Ship it.", add_special_tokens=False)["input_ids"]
    after = spm("[INST]Ship it.", add_special_tokens=False)["input_ids"][1:]
    assert alone != after
    template = BEFORE_LAST_USER.replace("<|im_start|>", "")
    cache = StaticPrefixCache(tokenize_check_rate=0)
    snap = assert_exact(cache, spm, template)
    assert snap["fast_tokenizations"] > 0 and snap["tokenize_mismatches"] == 0
    assert rule_of(spm).lines_off == "normalizer Replace acts across a cut"


def test_line_splits_cut_inside_tools_rendered_in_the_first_user_turn(llama3) -> None:
    """Llama 3.x renders the tools inside the first user turn: the last added token before the
    user text comes before all of them. A line split keeps the tail to the last tools."""
    tools = make_tools(16)
    cache = StaticPrefixCache(tokenize_check_rate=0)
    snap = assert_exact(cache, llama3, TOOLS_IN_FIRST_USER, tools)
    assert snap["fast_tokenizations"] == len(USER_TEXTS)
    r = cache.resolve(llama3, conv("Ship it."), tools, chat_template=TOOLS_IN_FIRST_USER)
    entry = decode_entry(cache.store.get(r.key), r.key, _check_of(cache, llama3, tools))
    assert entry.split is not None
    assert len(entry.split.text) - entry.split.anchor < len(entry.split.text) // 8


def _check_of(cache: StaticPrefixCache, tok: Any, tools: Any) -> int:
    return make_plan(tok, conv("x"), tools, None, TOOLS_IN_FIRST_USER, "default", None,
                     prefix=cache.prefix, protect_default_prefix=False,
                     renderers=cache._renderers, packer=KeyPacker()).check


@pytest.mark.parametrize("normalizer,pre_tokenizer,reason", [
    ({"type": "Prepend", "prepend": "▁"}, None, "normalizer Prepend"),
    ({"type": "Strip", "strip_left": True, "strip_right": False}, None, "normalizer Strip"),
    ({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Replace"}]}, None,
     "normalizer Replace"),
    (None, {"type": "Metaspace", "prepend_scheme": "first"}, "pre-tokenizer Metaspace"),
    (None, {"type": "Split", "pattern": {"Regex": r"(?<=\s)\S+|\s+"}, "behavior": "Isolated",
            "invert": False}, "look-behind"),
    (None, {"type": "Split", "pattern": {"Regex": r"\s+$|\S+"}, "behavior": "Isolated",
            "invert": False}, "anchors"),
    (None, {"type": "ByteLevel", "add_prefix_space": True}, "prefix space"),
    (None, {"type": "Sequence", "pretokenizers": []}, "one pre-token per piece"),
])
def test_line_splits_are_off_where_the_pipeline_acts_across_a_cut(normalizer: Any,
                                                                 pre_tokenizer: Any,
                                                                 reason: str) -> None:
    from prefix_cache.render.tokenizer_model import normalizer_off, pre_tokenizer_off

    split_like = {"type": "Split", "pattern": {"Regex": r"\p{L}+|\s+(?!\S)|\s+|[^\s\p{L}]+"},
                  "behavior": "Isolated", "invert": False}
    found = normalizer_off(normalizer) or pre_tokenizer_off(pre_tokenizer or split_like)
    assert found is not None and reason in found
    assert normalizer_off({"type": "NFC"}) is None and pre_tokenizer_off(split_like) is None


def test_real_tokenizers_line_split_rules(qwen3, llama3) -> None:
    assert rule_of(qwen3).lines_off is None and rule_of(llama3).lines_off is None
    assert "look-behind or anchors" in (rule_of(load_offline_tokenizer("deepseek")).lines_off or "")


def test_a_tokenizer_with_its_own_encode_has_no_fast_path(qwen3) -> None:
    class OwnEncode(type(qwen3)):  # type: ignore[misc]
        def _encode_plus(self, *args: Any, **kwargs: Any) -> Any:
            return super()._encode_plus(*args, **kwargs)

    tok = fresh(qwen3)
    tok.__class__ = OwnEncode
    cache = StaticPrefixCache(tokenize_check_rate=0)
    snap = assert_exact(cache, tok, DEFAULT_SYSTEM)
    assert snap["fast_tokenizations"] == 0 and snap["full_tokenizations"] == len(USER_TEXTS)
    assert list(snap["fast_tokenize_off"].values()) == ["OwnEncode encodes its own way"]


def test_a_static_text_without_a_safe_split_says_so(qwen3) -> None:
    plain = ("{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}")
    cache = StaticPrefixCache(tokenize_check_rate=0, observer=(metrics := Metrics()))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for _ in range(2):
        r = cache.resolve(qwen3, messages, chat_template=plain, model="plain")
        assert r.prompt_ids == reference.render(qwen3, messages, None, None, plain)
    snap = cache.stats.snapshot()
    assert snap["fast_tokenize_off"] == {"plain": "no safe split in this static text"}
    text = metrics.exposition()[0].decode()
    assert 'prefix_cache_prompt_tokenizations_total{path="full",reason="no_split"} 2.0' in text
    assert 'prefix_cache_fast_tokenize_off_total{model="plain"} 1.0' in text


# -- the run-time check -------------------------------------------------------------------------


def test_a_mismatch_turns_the_fast_path_off_logs_once_and_counts(qwen3, caplog) -> None:
    """A wrong split (as a bug in the split search would make) is caught by the sampled check:
    that request and every later one get the full tokenization's ids."""
    metrics = Metrics()
    cache = StaticPrefixCache(MemoryStore(), tokenize_check_rate=1.0, observer=metrics)
    first = cache.resolve(qwen3, conv("Ship it."), chat_template=DEFAULT_SYSTEM, model="m")
    plan = make_plan(qwen3, conv("x"), None, None, DEFAULT_SYSTEM, "default", "m",
                     prefix=cache.prefix, protect_default_prefix=False,
                     renderers=cache._renderers, packer=KeyPacker())
    good = decode_entry(cache.store.get(first.key), first.key, plan.check)
    assert good.split is not None
    # The same marker's first occurrence: the guard on the tail's first id lets it through.
    assert good.static_ids[0] == good.static_ids[good.split.index]
    wrong = StaticSplit(good.split.text, good.split.anchor, 0)
    cache.store.put(first.key, encode_entry(first.key, plan.check, good.packed_ids, 0.01,
                                            cap=good.cap, split=wrong))
    caplog.set_level(logging.WARNING, logger="prefix_cache")
    for text in ("Roll back.", "And the notes?"):
        r = cache.resolve(qwen3, conv(text), chat_template=DEFAULT_SYSTEM, model="m")
        assert r.hit and r.prompt_ids == reference.render(qwen3, conv(text), None, None,
                                                          DEFAULT_SYSTEM)
    snap = cache.stats.snapshot()
    assert snap["tokenize_mismatches"] == 1 and snap["tokenize_checks"] == 3
    assert "mismatch" in snap["fast_tokenize_off"]["m"]
    warnings = [r for r in caplog.records if "fast prompt tokenization is off" in r.message]
    assert len(warnings) == 1
    text = metrics.exposition()[0].decode()
    assert 'prefix_cache_tokenize_mismatches_total{model="m"} 1.0' in text
    assert 'prefix_cache_prompt_tokenizations_total{path="full",reason="off"} 2.0' in text
    # Another cache (another process) has its own switch; the tokenizer itself is fine.
    assert StaticPrefixCache(tokenize_check_rate=0).resolve(
        qwen3, conv("x"), chat_template=DEFAULT_SYSTEM).prompt_ids == reference.render(
        qwen3, conv("x"), None, None, DEFAULT_SYSTEM)


def test_check_rate_is_validated() -> None:
    for bad in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="tokenize check rate"):
            StaticPrefixCache(tokenize_check_rate=bad)  # type: ignore[arg-type]


# -- the direct render ------------------------------------------------------------------------


class Miscompiled(FastPromptText):
    """The real accelerated renderer, its direct render compiling another real template than
    it is given (the fault: a direct render that differs from apply_chat_template's)."""

    def compile(self, renderer: Any) -> Any:
        from prefix_cache.fastpath import _direct_render

        return _direct_render.compiled(renderer.target,
                                       (renderer.template or "").replace("system", "sys"))


class Drifting(FastPromptText):
    """The real accelerated renderer, its direct render going wrong after its first (checked)
    render."""

    renders = 0

    def render_direct(self, *args: Any) -> str:
        self.renders += 1
        text = super().render_direct(*args)
        return text if self.renders == 1 else text.replace("system", "sys")


def plan_of(tok: Any, template: str, text: str = "Hi") -> Any:
    """A real plan of ``conv(text)`` (keyed: its system message is static)."""
    return make_plan(tok, conv(text), None, None, template, "default", "m", prefix="pc",
                     protect_default_prefix=False, renderers=Renderers(), packer=KeyPacker())


def test_a_direct_render_that_differs_is_turned_off(qwen3) -> None:
    """The first direct render of a renderer is compared with apply_chat_template's, and the
    sampled check compares later ones: a difference turns it off and the official text wins.
    (Each case renders a template of its own, a Jinja comment apart, so it has its own
    renderer.)"""
    plan = plan_of(qwen3, DEFAULT_SYSTEM + "{# first render #}")
    official = plan.renderer.render_text(conv("Hi"), None, {})
    text = Miscompiled()
    assert text.render(plan, conv("Hi"), None) == official
    assert not text.renders_direct(plan.renderer)
    assert text.render(plan, conv("Hi"), None) == official
    assert not text.renders_direct(plan.renderer)  # off for good
    later = DEFAULT_SYSTEM + "{# a later render #}"
    plan, text = plan_of(qwen3, later, "Ship it."), Drifting()
    text.render(plan, conv("warm"), None)  # the first: checked, equal
    assert text.renders_direct(plan.renderer)
    drifted = text.render(plan, plan.messages, None)
    expected = reference.render(qwen3, conv("Ship it."), None, None, later)
    assert plan.renderer.tokenize(drifted) != expected  # the drifted render
    stats = CacheStats()
    tokens = FastPromptTokenizer(PromptTokenizer(stats), text, 1.0)
    ids = tokens.tokenize(plan, RenderedText(drifted, False), None)
    assert ids.ids == expected
    assert not text.renders_direct(plan.renderer)
    assert stats.snapshot()["tokenize_mismatches"] == 1


# -- everywhere a prompt is prepared ------------------------------------------------------------


async def test_aresolve_hits_tokenize_from_the_split(qwen3) -> None:
    cache = StaticPrefixCache(tokenize_check_rate=0)
    tools = make_tools(8)
    for text in USER_TEXTS:
        r = await cache.aresolve(qwen3, conv(text), tools, chat_template=DEFAULT_SYSTEM)
        assert r.prompt_ids == reference.render(qwen3, conv(text), tools, None, DEFAULT_SYSTEM)
    snap = cache.stats.snapshot()
    assert snap["hits"] == len(USER_TEXTS) - 1 and snap["fast_tokenizations"] == len(USER_TEXTS)


def test_cli_boundary_tokenizes_from_the_split(tmp_path: Path, capsys, monkeypatch) -> None:
    folder = make_model_dir(tmp_path / "m", "qwen3", DEFAULT_SYSTEM)
    requests = tmp_path / "r.jsonl"
    requests.write_text("".join(json.dumps({"messages": conv(t), "tools": make_tools(2)}) + "\n"
                                for t in USER_TEXTS))
    logging.getLogger("prefix_cache").handlers.clear()
    code = cli.main(["boundary", "--model", str(folder), "--requests", str(requests),
                     "--tokenize-check-rate", "1"])
    out = capsys.readouterr()
    assert code == 0
    tok = load_offline_tokenizer("qwen3")
    counts = [json.loads(line)["prompt_tokens"] for line in out.out.splitlines()]
    assert counts == [len(reference.render(tok, conv(t), make_tools(2), None, DEFAULT_SYSTEM))
                      for t in USER_TEXTS]
    assert f"fast_tokenizations={len(USER_TEXTS)} full_tokenizations=0" in out.err
    monkeypatch.setenv("PREFIX_CACHE_TOKENIZE_CHECK_RATE", "2")
    assert cli.main(["boundary", "--model", str(folder), "--requests", str(requests)]) == 2
    assert "PREFIX_CACHE_TOKENIZE_CHECK_RATE='2'" in capsys.readouterr().err


def test_the_sidecar_prepares_prompts_from_the_split(recorder_server, demo_tokenizer) -> None:
    """Boundary and chat endpoints: a hit's prompt ids (what the sidecar forwards to a
    specprefill upstream) are the full render's, tokenized from the split; /metrics counts it."""
    from prefix_cache.service.upstream import Upstream
    from tests.support.loopback import local_client
    from tests.support.server_thread import ServerThread
    from tests.support.sidecar import served, sidecar_app

    rec, url = recorder_server
    app = sidecar_app(served("spec", demo_tokenizer, Upstream(url, "specprefill")),
                      tokenize_check_rate=1.0)
    tools = make_tools(6)
    with ServerThread(app) as base, local_client(base_url=base) as http:
        for text in USER_TEXTS:
            body = {"model": "spec", "messages": conv(text), "tools": tools}
            expected = reference.render(demo_tokenizer, conv(text), tools, None, None)
            got = http.post("/v1/prefix/boundary", json={**body, "return_prompt_ids": True})
            assert got.status_code == 200 and got.json()["prompt_ids"] == expected
            sent = http.post("/v1/chat/completions", json=body)
            assert sent.status_code == 200 and sent.headers["x-prefix-cache"] == "hit"
            assert rec.last.body["prompt_token_ids"] == expected
        metrics = http.get("/metrics").text
    fast = 2 * len(USER_TEXTS)
    assert f'prefix_cache_prompt_tokenizations_total{{path="fast",reason=""}} {fast}.0' in metrics
    assert "\nprefix_cache_tokenize_mismatches_total{" not in metrics  # no mismatch seen
    assert f"prefix_cache_tokenize_checks_total {fast}.0" in metrics


def test_tojson_texts_are_reused_per_key_and_never_across_tenants(qwen3) -> None:
    """A hit's render reuses the tools' tojson texts its key fixes; each namespace has its own."""
    from prefix_cache.fastpath import typed_key

    tools = make_tools(5, seed=13)
    cache = StaticPrefixCache(tokenize_check_rate=0)
    keys: dict[str, str] = {}
    for ns in ("tenant-a", "tenant-b"):
        for text in ("Ship it.", "Roll back."):
            r = cache.resolve(qwen3, conv(text), tools, chat_template=TOOLS_IN_FIRST_USER,
                              namespace=ns)
            assert r.prompt_ids == reference.render(qwen3, conv(text), tools, None,
                                                    TOOLS_IN_FIRST_USER)
        keys[ns] = r.key
    assert keys["tenant-a"] != keys["tenant-b"]
    remembered = {ns: cache._text.remembered_tojson(key)  # type: ignore[attr-defined]
                  for ns, key in keys.items()}
    assert remembered["tenant-a"] and remembered["tenant-b"]  # each key its own texts
    texts = remembered["tenant-a"]  # the template asks tojson(indent=4): not the plain call
    assert sorted(at[0] for at in texts) == list(range(len(tools)))  # one text per tool
    assert all(at[1] == typed_key((False, 4, None, False)) for at in texts)
    assert texts[(0, typed_key((False, 4, None, False)))] == \
        json.dumps(tools[0], ensure_ascii=False, indent=4)


def sampler_of(rate: float, rng: random.Random | None = None) -> FastPromptTokenizer:
    return FastPromptTokenizer(PromptTokenizer(CacheObserver()), FastPromptText(), rate, rng)


def checked(sampler: FastPromptTokenizer, monkeypatch: Any, seconds: float) -> None:
    """One real sampled check (a direct render's, of the demo template) that took ``seconds``
    on the checks' clock."""
    plan = plan_of(load_offline_tokenizer("qwen3"), DEFAULT_SYSTEM)
    text = sampler.text.render(plan, plan.messages, None)
    ticks = iter([0.0, seconds])
    with monkeypatch.context() as patched:
        patched.setattr(_fast_tokenize.time, "perf_counter", lambda: next(ticks))
        sampler.tokenize(plan, RenderedText(text, False), None, check=True)
    assert next(ticks, None) is None  # the check was timed


def test_sampled_checks_are_held_to_their_share_of_the_time(monkeypatch: Any) -> None:
    """Below a rate of 1, a drawn check is skipped while the checks so far took more than
    CHECK_TIME_SHARE of the time since the first draw (the first drawn check always runs); a
    rate of 1 checks every prompt whatever they cost."""
    clock = [1000.0]
    monkeypatch.setattr(_fast_tokenize.time, "monotonic", lambda: clock[0])
    sampler = sampler_of(0.5, random.Random(3))
    drawn = [sampler.sampled() for _ in range(200)]
    assert 60 < sum(drawn) < 140  # the rate alone while the checks cost nothing
    checked(sampler, monkeypatch, 1.0)  # a check took 1 s, no time has passed
    assert not any(sampler.sampled() for _ in range(200))
    clock[0] += 1.0 / prompt_tokens.CHECK_TIME_SHARE  # their share of 100 s is 1 s: due again
    assert any(sampler.sampled() for _ in range(20))
    always = sampler_of(1.0)
    checked(always, monkeypatch, 1e9)
    assert all(always.sampled() for _ in range(20))
    assert not any(sampler_of(0.0).sampled() for _ in range(20))


@pytest.mark.parametrize("name", ["qwen3", "llama3.1", "deepseek", "spm-v7"])
def test_a_tail_tokenized_straight_from_the_backend_is_the_full_call(name: str) -> None:
    """``tokenize_tail`` skips transformers' wrapper only where the wrapper would only call the
    backend: the same ids, and the wrapper itself once the backend truncates or pads, or
    special tokens are to be split."""
    tok = fresh(load_offline_tokenizer(name))
    renderer = get_renderer(tok, DEFAULT_SYSTEM)
    special = tok.all_special_tokens[0] if tok.all_special_tokens else ""
    texts = ["", " ", "Fix the failing test in module_7.py.", f"{special}user\nhi{special}\n",
             "naïve café — 日本語 🙂\r\n\t  x", "a" * 3000]
    for text in texts:
        assert renderer.tokenize_tail(text) == renderer.tokenize(text), (name, text[:20])
    backend = tok.backend_tokenizer
    calls: list[str] = []
    wrapped = renderer.tokenize
    renderer.tokenize = lambda text: calls.append(text) or wrapped(text)  # type: ignore[method-assign]
    backend.enable_truncation(4)
    assert renderer.tokenize_tail(texts[2]) == wrapped(texts[2]) and calls == [texts[2]]
    backend.no_truncation()
    tok.split_special_tokens = True  # a new state: the next call's key and renderer read it
    split = get_renderer(tok, DEFAULT_SYSTEM)
    assert split is not renderer and split.split_special_tokens
    calls.clear()
    wrapped_split = split.tokenize
    split.tokenize = lambda text: calls.append(text) or wrapped_split(text)  # type: ignore[method-assign]
    assert split.tokenize_tail(texts[3]) == wrapped_split(texts[3]) and len(calls) == 1
    # A renderer keeps the state its key read, whatever the attribute says now.
    assert wrapped(texts[3]) == tok(texts[3], add_special_tokens=False,
                                    split_special_tokens=False)["input_ids"]

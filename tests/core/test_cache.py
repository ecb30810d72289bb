"""StaticPrefixCache behaviour: hits render nothing, single-flight, failures degrade to computing."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime
from typing import Any

import pytest

from prefix_cache import (
    InvalidRequestError,
    MemoryStore,
    NoChatTemplateError,
    StaticPrefixCache,
    Store,
    StoreUnavailableError,
)
from prefix_cache.cache.entry import encode_entry

from tests.support import reference
from tests.support.templates import BEHAVIOURS
from tests.support.tools import make_tools

TEMPLATE = BEHAVIOURS["default_system"]
SYSTEM = {"role": "system", "content": "You are the release agent."}


def conv(user: str = "Ship it.", system: dict[str, Any] = SYSTEM) -> list[dict[str, Any]]:
    return [system, {"role": "user", "content": user}]


class RenderSpy:
    """Counts real apply_chat_template calls on the real tokenizer; optionally slows them."""

    def __init__(self, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> None:
        self.calls = 0
        self._lock = threading.Lock()
        original = tokenizer.apply_chat_template

        def spy(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls += 1
            if delay:
                time.sleep(delay)
            return original(*args, **kwargs)

        # setitem, not setattr: undoing setattr on an instance would leave the bound method of
        # this tokenizer in its __dict__, and copies of it would then render with this one.
        monkeypatch.setitem(tokenizer.__dict__, "apply_chat_template", spy)


def test_hit_runs_no_probe_render(qwen3, monkeypatch) -> None:
    # Renders are counted: no sampled check (1% by default), whose official render would count.
    cache = StaticPrefixCache(tokenize_check_rate=0)
    tools = make_tools(8)
    first = cache.resolve(qwen3, conv(), tools, chat_template=TEMPLATE)
    spy = RenderSpy(qwen3, monkeypatch)
    for user in ("Ship it.", "Roll back.", "What changed?"):
        prompt = reference.render(qwen3, conv(user), tools, None, TEMPLATE)
        before = spy.calls
        r = cache.resolve(qwen3, conv(user), tools, prompt_ids=prompt, chat_template=TEMPLATE)
        assert r.cache == "hit" and spy.calls == before  # no render at all on a hit
        assert r.specprefill_system_end == first.specprefill_system_end
    # Without prompt ids, a hit renders the prompt itself and nothing more.
    before = spy.calls
    assert cache.resolve(qwen3, conv("again"), tools, chat_template=TEMPLATE).hit
    assert spy.calls == before + 1
    snap = cache.stats.snapshot()
    assert snap["renders"] == 4 and snap["hits"] == 4 and snap["misses"] == 1


def test_miss_runs_the_two_probes_and_the_two_multi_turn_probes(qwen3, monkeypatch) -> None:
    spy = RenderSpy(qwen3, monkeypatch)
    prompt = [1, 2, 3]
    StaticPrefixCache().resolve(qwen3, conv(), make_tools(2), prompt_ids=prompt, chat_template=TEMPLATE)
    assert spy.calls == 4


def test_single_flight_across_threads(qwen3, monkeypatch) -> None:
    cache = StaticPrefixCache()
    spy = RenderSpy(qwen3, monkeypatch, delay=0.05)
    prompt = reference.render(qwen3, conv(), make_tools(4), None, TEMPLATE)
    spy.calls = 0
    barrier = threading.Barrier(8)
    results: list[Any] = []

    def work() -> None:
        barrier.wait()
        results.append(cache.resolve(qwen3, conv(), make_tools(4), prompt_ids=prompt, chat_template=TEMPLATE))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert spy.calls == 4  # one flight: four probe renders for eight requests
    assert len({r.specprefill_system_end for r in results}) == 1
    assert cache.stats.snapshot()["renders"] == 4


async def test_single_flight_across_tasks_and_threads(qwen3, monkeypatch) -> None:
    cache = StaticPrefixCache()
    spy = RenderSpy(qwen3, monkeypatch, delay=0.05)
    tools = make_tools(3)
    prompt = reference.render(qwen3, conv(), tools, None, TEMPLATE)
    spy.calls = 0
    thread_results: list[Any] = []
    thread = threading.Thread(target=lambda: thread_results.append(
        cache.resolve(qwen3, conv(), tools, prompt_ids=prompt, chat_template=TEMPLATE)))
    thread.start()
    results = await asyncio.gather(*(
        cache.aresolve(qwen3, conv(), tools, prompt_ids=prompt, chat_template=TEMPLATE) for _ in range(20)
    ))
    await asyncio.to_thread(thread.join)
    assert spy.calls == 4
    ends = {r.specprefill_system_end for r in [*results, *thread_results]}
    assert ends == {reference.two_probe(qwen3, conv(), tools, template=TEMPLATE)}


async def test_cancelled_waiter_does_not_cancel_the_flight(qwen3, monkeypatch) -> None:
    cache = StaticPrefixCache()
    RenderSpy(qwen3, monkeypatch, delay=0.1)
    leader = asyncio.create_task(cache.aresolve(qwen3, conv(), prompt_ids=[1], chat_template=TEMPLATE))
    follower = asyncio.create_task(cache.aresolve(qwen3, conv(), prompt_ids=[1], chat_template=TEMPLATE))
    await asyncio.sleep(0.02)
    leader.cancel()
    r = await follower
    assert r.cache == "miss"
    assert (await cache.aresolve(qwen3, conv(), prompt_ids=[1], chat_template=TEMPLATE)).cache == "hit"


async def test_aresolve_equals_resolve(qwen3) -> None:
    tools = make_tools(5)
    sync = StaticPrefixCache().resolve(qwen3, conv(), tools, chat_template=TEMPLATE)
    cache = StaticPrefixCache()
    miss = await cache.aresolve(qwen3, conv(), tools, chat_template=TEMPLATE)
    hit = await cache.aresolve(qwen3, conv(), tools, chat_template=TEMPLATE)
    assert (miss.cache, hit.cache) == ("miss", "hit")
    for r in (miss, hit):
        assert (r.specprefill_system_end, r.prompt_ids, r.key) == (
            sync.specprefill_system_end, sync.prompt_ids, sync.key)


class BrokenStore(Store):
    """A store that is down: every call fails the way a real backend reports it."""

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self) -> Any:
        self.calls += 1
        raise StoreUnavailableError("connection refused")

    def get(self, key: str) -> bytes | None:
        return self._fail()

    def put(self, key: str, value: bytes, ttl_seconds: float | None = None) -> None:
        self._fail()

    def delete(self, key: str) -> bool:
        return self._fail()

    def purge(self, pattern: str) -> int:
        return self._fail()


async def test_store_down_degrades_to_computing(qwen3) -> None:
    store = BrokenStore()
    cache = StaticPrefixCache(store)
    tools = make_tools(2)
    expected = reference.two_probe(qwen3, conv(), tools, template=TEMPLATE)
    assert cache.resolve(qwen3, conv(), tools, chat_template=TEMPLATE).specprefill_system_end == expected
    r = await cache.aresolve(qwen3, conv(), tools, chat_template=TEMPLATE)
    assert r.specprefill_system_end == expected and r.cache == "miss"
    assert cache.stats.snapshot()["store_errors"] == store.calls > 0


@pytest.mark.parametrize("damage", ["random", "truncated", "foreign", "collision"])
def test_bad_entry_is_recomputed_and_replaced(qwen3, damage: str) -> None:
    store = MemoryStore()
    cache = StaticPrefixCache(store)
    tools = make_tools(2)
    good = cache.resolve(qwen3, conv(), tools, chat_template=TEMPLATE)
    value = store.get(good.key)
    assert value is not None
    wrong_ids = list(range(good.static_tokens + 50))  # would over-report if ever believed
    bad = {
        "random": bytes(reversed(value)),
        "truncated": value[: len(value) // 2],
        "foreign": encode_entry("spc:default:other:ffff", 7, wrong_ids, 0.1),
        "collision": encode_entry(good.key, 7, wrong_ids, 0.1),
    }[damage]
    store.put(good.key, bad)
    again = cache.resolve(qwen3, conv(), tools, chat_template=TEMPLATE)
    assert again.cache == "miss" and again.specprefill_system_end == good.specprefill_system_end
    assert cache.stats.snapshot()["verification_failures"] == 1
    replaced = store.get(good.key)  # replaced by a good entry
    assert replaced is not None and replaced[:16] == value[:16] and replaced[24:-8] == value[24:-8]
    assert cache.resolve(qwen3, conv(), tools, chat_template=TEMPLATE).cache == "hit"


def test_date_change_is_a_miss_with_the_new_date(qwen3, monkeypatch) -> None:
    import transformers.utils.chat_template_utils as ctu

    import prefix_cache.render._template_clock as render  # where the key reads the clock

    template = BEHAVIOURS["todays_date"]

    def at(day: int) -> type[datetime]:
        class Frozen(datetime):
            @classmethod
            def now(cls, tz: Any = None) -> datetime:  # noqa: ARG003
                return datetime(2026, 12, day, 23, 59)
        return Frozen

    cache = StaticPrefixCache()
    for module in (ctu, render):
        monkeypatch.setattr(module, "datetime", at(2))
    today = cache.resolve(qwen3, conv(), chat_template=template)
    assert cache.resolve(qwen3, conv(), chat_template=template).hit
    for module in (ctu, render):
        monkeypatch.setattr(module, "datetime", at(3))
    tomorrow = cache.resolve(qwen3, conv(), chat_template=template)
    assert tomorrow.cache == "miss" and tomorrow.key != today.key
    assert "03 Dec 2026" in qwen3.decode(tomorrow.prompt_ids[: tomorrow.specprefill_system_end])
    assert tomorrow.specprefill_system_end == reference.two_probe(qwen3, conv(), template=template)


@pytest.mark.parametrize("messages,tools,kwargs,match", [
    ([], None, None, "non-empty"),
    ("hello", None, None, "non-empty list"),
    ([{"role": "robot", "content": "x"}], None, None, "robot"),
    ([{"role": "system", "content": 5}], None, None, "content"),
    ([SYSTEM, {"role": "user", "content": ["text"]}], None, None, r"content\[0\]"),
    (conv(), {"name": "x"}, None, "tools must be a list"),
    (conv(), ["x"], None, r"tools\[0\]"),
    (conv(), None, ["x"], "chat_template_kwargs must be an object"),
    (conv(), None, {"tokenize": False}, "tokenize"),
    (conv(), None, {"add_generation_prompt": False}, "add_generation_prompt"),
])
def test_bad_input_is_a_clear_error(qwen3, messages, tools, kwargs, match) -> None:
    cache = StaticPrefixCache()
    with pytest.raises(InvalidRequestError, match=match):
        cache.resolve(qwen3, messages, tools, kwargs, chat_template=TEMPLATE)
    assert len(cache.store) == 0


def test_no_chat_template(qwen3) -> None:
    assert not qwen3.chat_template
    with pytest.raises(NoChatTemplateError):
        StaticPrefixCache().resolve(qwen3, conv())


def test_mlx_lm_tokenizer_wrapper_is_accepted(qwen3) -> None:
    """A wrapper renders through its own apply_chat_template (what it injects is in its key);
    on a template that ignores the injection the answer is the bare tokenizer's."""
    tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")
    wrapped = tokenizer_utils.TokenizerWrapper(qwen3)
    cache = StaticPrefixCache()
    a = cache.resolve(wrapped, conv(), make_tools(2), chat_template=TEMPLATE)
    b = cache.resolve(qwen3, conv(), make_tools(2), chat_template=TEMPLATE)
    assert a.key != b.key and (a.cache, b.cache) == ("miss", "miss")
    assert a.specprefill_system_end == b.specprefill_system_end == reference.two_probe(
        wrapped, conv(), make_tools(2), template=TEMPLATE)
    assert cache.resolve(wrapped, conv("Roll back."), make_tools(2), chat_template=TEMPLATE).hit


def test_namespaces_never_share_an_entry(qwen3) -> None:
    cache = StaticPrefixCache()
    a = cache.resolve(qwen3, conv(), chat_template=TEMPLATE, namespace="tenant-a")
    b = cache.resolve(qwen3, conv(), chat_template=TEMPLATE, namespace="tenant-b")
    assert a.cache == b.cache == "miss" and a.key != b.key
    assert a.key.split(":")[1] == "tenant-a" and b.key.split(":")[1] == "tenant-b"


class RecordingObserver:
    """Collects every event the cache reports (the base class is the no-op reference)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda **kw: self.events.append((name, kw))


def test_observer_sees_every_event(qwen3) -> None:
    obs = RecordingObserver()
    store = MemoryStore()
    cache = StaticPrefixCache(store, observer=obs, tokenize_check_rate=0)  # type: ignore[arg-type]
    miss = cache.resolve(qwen3, conv(), chat_template=TEMPLATE, namespace="t1", model="m")
    cache.resolve(qwen3, conv(), chat_template=TEMPLATE, namespace="t1", model="m")
    cache.resolve(qwen3, [{"role": "user", "content": "x"}], chat_template=TEMPLATE, namespace="t1", model="m")
    store.put(miss.key, b"junk")
    cache.resolve(qwen3, conv(), chat_template=TEMPLATE, namespace="t1", model="m")
    with pytest.raises(InvalidRequestError):
        cache.resolve(qwen3, [{"role": "robot"}], chat_template=TEMPLATE, namespace="t1", model="m")
    names = [name for name, _ in obs.events]
    assert names == ["prompt_rendered", "computed", "tokenized", "resolved",
                     "prompt_rendered", "tokenized", "saved", "resolved",
                     "prompt_rendered", "tokenized", "resolved",
                     "verification_failure", "prompt_rendered", "computed", "tokenized",
                     "resolved", "failed"]
    tokenized = [kw for name, kw in obs.events if name == "tokenized"]
    assert [(t["fast"], t["reason"]) for t in tokenized] == [
        (True, ""), (True, ""), (False, "no_static"), (True, "")]
    resolved = [kw for name, kw in obs.events if name == "resolved"]
    assert [r["cache"] for r in resolved] == ["miss", "hit", "none", "miss"]
    assert all(r["namespace"] == "t1" and r["model"] == "m" and r["seconds"] > 0 for r in resolved)
    assert resolved[0]["boundary"] == miss.specprefill_system_end
    assert resolved[0]["static_tokens"] == miss.static_tokens

    broken = RecordingObserver()
    StaticPrefixCache(BrokenStore(), observer=broken).resolve(qwen3, conv(), chat_template=TEMPLATE)  # type: ignore[arg-type]
    assert ("store_error", {"op": "get"}) in broken.events

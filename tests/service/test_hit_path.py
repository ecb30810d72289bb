"""The hit path made short (issue 30): every way a hit is now served gives the uncached answer.

In process, ``aresolve`` serves a hit with a short dynamic part on the event loop and the rest
(long prompts, sampled full checks, the cap's extra render) in its render threads; the prompt's
ids are a list only when read. Through HTTP, ``POST /v1/prefix/boundary`` takes the client's
``prompt_ids``: the boundary is cut against them, and ids that are not token ids get a 400 and
cache nothing. Real Qwen3 tokenizers and templates, a real uvicorn."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import orjson
import pytest

from prefix_cache import StaticPrefixCache
from prefix_cache.cache.cache import INLINE_HIT_CHARS
from prefix_cache.errors import InvalidRequestError
from prefix_cache.service import ServiceSettings, create_app
from prefix_cache.service.served_models import ModelRegistry
from prefix_cache.util.token_ids import checked_token_ids, unpack_ids
from tests.support import reference
from tests.support.loopback import local_client
from tests.support.server_thread import ServerThread
from tests.support.sidecar import served, unique_system
from tests.support.templates import BEHAVIOURS
from tests.support.tools import make_tools

TEMPLATE = BEHAVIOURS["default_system"]
SYSTEM = {"role": "system", "content": "Follow the repository rules. You are the release agent."}
ASSISTANT = {"role": "assistant", "content": "Three tests fail in test_io.py."}


CASES = {
    # name: (messages, tools, template, render threads a hit uses with no sampled check)
    "short": ([SYSTEM, {"role": "user", "content": "Ship it."}], 3, TEMPLATE, 0),
    "long": ([SYSTEM, {"role": "user", "content": "Ship it. " * (INLINE_HIT_CHARS // 9 + 1)}],
             3, TEMPLATE, 1),
    "multi-turn, named": ([SYSTEM, {"role": "user", "content": "Go", "name": "ana"}, ASSISTANT,
                           {"role": "user", "content": "Fix the first one."}], 3, TEMPLATE, 0),
    # Mistral-like, the first user text starting like the system text: the cut passes the
    # multi-turn cap, so the hit renders once more (in a thread).
    "past the cap": ([SYSTEM, {"role": "user", "content": "Follow them, list the failing tests."},
                      ASSISTANT, {"role": "user", "content": "Fix the first one."}], 0,
                     BEHAVIOURS["before_last_user"], 1),
}


@pytest.mark.parametrize("check_rate", [0.0, 1.0])
@pytest.mark.parametrize("case", list(CASES))
async def test_every_hit_path_gives_the_uncached_answer(qwen3: Any, case: str,
                                                       check_rate: float) -> None:
    messages, n_tools, template, threads = CASES[case]
    tools = make_tools(n_tools) or None
    uncached = StaticPrefixCache().resolve(qwen3, messages, tools, chat_template=template)
    cache = StaticPrefixCache(tokenize_check_rate=check_rate)
    miss = await cache.aresolve(qwen3, messages, tools, chat_template=template)
    submitted, checks = cache.render_thread_calls, cache.stats.tokenize_checks
    hit = await cache.aresolve(qwen3, messages, tools, chat_template=template)
    assert (miss.cache, hit.cache) == ("miss", "hit")
    prompt = reference.render(qwen3, messages, tools, None, template)
    for r in (miss, hit):
        assert r.specprefill_system_end == uncached.specprefill_system_end
        assert type(r.prompt_ids) is list and r.prompt_ids == prompt
        assert r.prompt_tokens == len(prompt)
    if case == "past the cap":
        assert cache.stats.cap_renders == 2  # the miss's and the hit's
    if check_rate:  # the sampled check ran, in a render thread (the cap's render with it)
        assert cache.stats.tokenize_checks == checks + 1
        assert cache.render_thread_calls == submitted + 1
    else:
        assert cache.render_thread_calls == submitted + threads


def test_prompt_ids_are_made_once_and_compare_by_value(qwen3: Any) -> None:
    cache = StaticPrefixCache(tokenize_check_rate=0.0)
    messages = [SYSTEM, {"role": "user", "content": "Ship it."}]
    cache.resolve(qwen3, messages, chat_template=TEMPLATE)
    hit = cache.resolve(qwen3, messages, chat_template=TEMPLATE)
    again = cache.resolve(qwen3, messages, chat_template=TEMPLATE)
    assert hit.prompt_ids is hit.prompt_ids  # made on first read, then kept
    assert hit == again and hit.prompt_ids == again.prompt_ids


# -- POST /v1/prefix/boundary with the client's prompt ids ------------------------------------


@pytest.fixture(scope="module")
def base(demo_tokenizer: Any) -> Any:
    app = create_app(ServiceSettings(), models=ModelRegistry([served("demo", demo_tokenizer)]))
    with ServerThread(app) as url:
        yield url, app


def _entries(app: Any) -> int:
    return int(app.state.service.store.stats().memory.entries)


def test_boundary_is_cut_against_the_prompt_ids_sent(base: Any, demo_tokenizer: Any) -> None:
    url, _ = base
    body = {"messages": [unique_system("ids"), {"role": "user", "content": "Deploy it."}],
            "tools": make_tools(4)}
    prompt = reference.render(demo_tokenizer, body["messages"], body["tools"], None, None)
    expected = reference.two_probe(demo_tokenizer, body["messages"], body["tools"])
    with local_client(base_url=url) as http:
        rendered = http.post("/v1/prefix/boundary", json=body).json()
        sent = http.post("/v1/prefix/boundary", json={**body, "prompt_ids": prompt,
                                                      "return_prompt_ids": True}).json()
        cut = http.post("/v1/prefix/boundary", json={**body, "prompt_ids": prompt[:expected - 3]})
    assert (rendered["cache"], sent["cache"]) == ("miss", "hit")
    assert rendered["specprefill_system_end"] == sent["specprefill_system_end"] == expected > 0
    assert sent["prompt_ids"] == prompt and sent["prompt_tokens"] == len(prompt)
    assert cut.json()["specprefill_system_end"] == expected - 3  # never past the ids sent
    assert cut.headers["x-specprefill-system-end"] == str(expected - 3)


@pytest.mark.parametrize("ids", ["1 2 3", [1, "2"], [-1], [2**32], [1.5], [[1]], {"0": 1}],
                         ids=["text", "a string id", "negative", "2**32", "float", "nested",
                              "object"])
@pytest.mark.parametrize("cached", [False, True], ids=["new key", "cached key"])
def test_prompt_ids_that_are_not_token_ids_are_a_400(base: Any, ids: Any, cached: bool) -> None:
    url, app = base
    body = {"messages": [unique_system("bad-ids"), {"role": "user", "content": "Deploy it."}]}
    with local_client(base_url=url) as http:
        if cached:
            assert http.post("/v1/prefix/boundary", json=body).json()["cache"] == "miss"
        before = _entries(app)
        r = http.post("/v1/prefix/boundary", json={**body, "prompt_ids": ids})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_request" and "prompt_ids" in error["message"]
        assert _entries(app) == before, "a refused request cached something"
        again = http.post("/v1/prefix/boundary", json=body).json()
        assert again["cache"] == ("hit" if cached else "miss")


# -- large bodies: their parts remembered, and shared on this route (body_parts) ----------------


@pytest.mark.parametrize("check_rate", [0.0, 1.0])
def test_large_bodies_answer_as_the_uncached_render(demo_tokenizer: Any, check_rate: float) -> None:
    """Tools and a system prompt over ``REMEMBERED_BYTES`` are remembered by their bytes and
    their parsed values shared between hits: every answer is still the uncached one (with the
    sampled full check on every hit too: the official render reads the shared values), and the
    shared values are still exactly what their bytes parse to afterwards."""
    app = create_app(ServiceSettings(tokenize_check_rate=check_rate),
                     models=ModelRegistry([served("demo", demo_tokenizer)]))
    system = {"role": "system", "content": "Follow the repository rules. " * 60}
    tools = make_tools(12)
    turns = [[system, {"role": "user", "content": f"Fix test {i}."}] for i in range(4)]
    with ServerThread(app) as url, local_client(base_url=url) as http:
        for round_ in range(3):
            for messages in turns:
                prompt = reference.render(demo_tokenizer, messages, tools, None, None)
                expected = reference.two_probe(demo_tokenizer, messages, tools)
                for extra in ({}, {"prompt_ids": prompt}):
                    r = http.post("/v1/prefix/boundary", json={
                        "messages": messages, "tools": tools, "return_prompt_ids": True,
                        **extra}).json()
                    assert r["specprefill_system_end"] == expected > 0
                    assert r["prompt_ids"] == prompt
                    assert r["cache"] == ("miss" if (round_, messages, extra) ==
                                          (0, turns[0], {}) else "hit")
            bad = http.post("/v1/prefix/boundary", json={
                "messages": turns[0], "tools": tools, "prompt_ids": [1, 2**32]})
            assert bad.status_code == 400 and "prompt_ids[1]" in bad.json()["error"]["message"]
    memo = app.state.api_host.parts
    remembered = memo.remembered()
    assert len(remembered) >= 2  # the tools and the system message
    for found in remembered:
        assert found.value == orjson.loads(found.part)
        assert orjson.dumps(found.value) == orjson.dumps(orjson.loads(found.part))
    last_ids, = memo.remembered_ids()  # the last ids sent (one agent), text and packed
    assert unpack_ids(last_ids.packed) == orjson.loads(last_ids.part)


@pytest.mark.parametrize("kind", ["numpy uint32", "numpy int64", "array.array", "TokenIds"])
def test_prompt_ids_as_the_arrays_an_engine_holds(qwen3: Any, kind: str) -> None:
    """An engine's ids (an mlx array through ``np.asarray``, an ``array.array``) are taken as
    they are: the same answer as the list, with no Python int made per id."""
    messages = [SYSTEM, {"role": "user", "content": "Ship it."}]
    tools = make_tools(3)
    ids = reference.render(qwen3, messages, tools, None, TEMPLATE)
    given = {"numpy uint32": lambda: np.asarray(ids, dtype=np.uint32),
             "numpy int64": lambda: np.asarray(ids, dtype=np.int64),
             "array.array": lambda: array("I", ids),
             "TokenIds": lambda: checked_token_ids(ids)}[kind]()
    cache = StaticPrefixCache()
    for expected in ("miss", "hit"):
        r = cache.resolve(qwen3, messages, tools, prompt_ids=given, chat_template=TEMPLATE)
        listed = StaticPrefixCache().resolve(qwen3, messages, tools, prompt_ids=ids,
                                             chat_template=TEMPLATE)
        assert r.cache == expected and r.prompt_ids == ids
        assert r.specprefill_system_end == listed.specprefill_system_end > 0


@pytest.mark.parametrize("bad", [np.array([1.5]), np.array([[1, 2]]), np.array([-1, 2]),
                                 np.array([2**32], dtype=np.int64), np.array(["1"])],
                         ids=["float", "2-d", "negative", "2**32", "strings"])
def test_arrays_that_are_not_token_ids_are_refused_before_anything_is_stored(
        qwen3: Any, bad: Any) -> None:
    cache = StaticPrefixCache()
    with pytest.raises(InvalidRequestError, match="prompt_ids"):
        cache.resolve(qwen3, [SYSTEM, {"role": "user", "content": "Go"}], prompt_ids=bad,
                      chat_template=TEMPLATE)
    assert cache.store.stats().memory.entries == 0


@pytest.mark.parametrize("ids", ["[1, true, 3]", "[false]", "[5, 6, true]"])
def test_json_booleans_are_not_token_ids(base: Any, ids: str) -> None:
    """JSON true/false would pack as 1 and 0: a 400 naming the first, on bodies parsed whole
    and part by part, and after a list of ids the tenant sent before (the part of the text
    equal to that list is taken as its ids)."""
    url, _ = base
    with local_client(base_url=url) as http:
        for pad in ("", "x" * 4096):
            for sent in ("[1, 5, 6]", ids):
                raw = ('{"messages": [{"role": "system", "content": "S%s"}, {"role": "user", '
                       '"content": "hi"}], "prompt_ids": %s}' % (pad, sent)).encode()
                r = http.post("/v1/prefix/boundary", content=raw,
                              headers={"content-type": "application/json"})
                if sent == ids:
                    assert r.status_code == 400, r.text
                    assert " is true" in r.text or " is false" in r.text
                else:
                    assert r.status_code == 200, r.text

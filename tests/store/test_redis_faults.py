"""Redis faults with a real redis-server: killed, hung, restarted, corrupted, full.

Every request must still get the right boundary and no error; while the breaker is open no
request touches Redis.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from typing import Any

import pytest

from prefix_cache import StaticPrefixCache
from prefix_cache.cache.entry import VERSION
from prefix_cache.store.breaker import CLOSED, OPEN, CircuitBreaker, ExponentialBackoff
from prefix_cache.store.redis import RedisStore

from tests.support import reference
from tests.support.clock import Clock
from tests.support.redis_server import needs_redis
from tests.support.templates import BEHAVIOURS
from tests.support.tools import make_tools

pytestmark = needs_redis
TEMPLATE = BEHAVIOURS["default_system"]


def request(i: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Requests of three agents (three static parts), different user turns."""
    agent = i % 3
    return ([{"role": "system", "content": f"You are agent {agent}."},
             {"role": "user", "content": f"task {i}"}], make_tools(agent + 1, seed=agent))


def expected_end(tok: Any, i: int) -> int:
    messages, tools = request(i)
    return reference.two_probe(tok, messages, tools, template=TEMPLATE)


def test_breaker_states_and_backoff() -> None:
    clock = Clock()
    b = CircuitBreaker(ExponentialBackoff(1.0, 4.0), timer=clock)
    assert b.allow() and b.state == CLOSED
    b.record_failure()
    assert b.state == OPEN and not b.allow()
    clock.now = 1.0
    assert b.allow() and not b.allow()  # one probe in half-open
    b.record_failure()                   # probe failed: window doubles
    clock.now = 2.5
    assert not b.allow()
    clock.now = 3.0
    assert b.allow()
    b.record_success()
    assert b.state == CLOSED and b.allow()
    assert [ExponentialBackoff(1.0, 4.0).compute(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="base_seconds"):
        ExponentialBackoff(0, 1)


def test_killed_during_stream_then_restarted(qwen3, redis) -> None:
    clock = Clock()
    store = RedisStore(redis.url, breaker=CircuitBreaker(ExponentialBackoff(5.0, 60.0), timer=clock))
    cache = StaticPrefixCache(store)
    truth = {i: expected_end(qwen3, i) for i in range(3)}
    for i in range(60):
        if i == 20:
            redis.kill()
            calls_at_kill = store.calls
        messages, tools = request(i)
        r = cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE)
        assert r.specprefill_system_end == truth[i % 3]
    assert store.calls == calls_at_kill + 1  # the one call that found it dead; then the breaker
    assert store.breaker.state == OPEN and store.skipped > 0
    redis.start()
    clock.now += 5.0  # the probe window passes: the next call probes and closes the breaker
    for i in range(60, 66):
        messages, tools = request(i)
        assert cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE).specprefill_system_end == truth[i % 3]
    assert store.breaker.state == CLOSED
    hits_before = cache.stats.snapshot()["hits"]
    messages, tools = request(3)
    assert cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE).hit  # hits resume
    assert cache.stats.snapshot()["hits"] == hits_before + 1


async def test_hung_redis_costs_one_timeout_then_nothing(qwen3, redis) -> None:
    store = RedisStore(redis.url, timeout_seconds=0.05,
                       breaker=CircuitBreaker(ExponentialBackoff(30.0, 60.0)))
    cache = StaticPrefixCache(store)
    messages, tools = request(0)
    await cache.aresolve(qwen3, messages, tools, chat_template=TEMPLATE)
    redis.pause()
    try:
        started = time.perf_counter()
        for i in range(30):
            messages, tools = request(i)
            r = await cache.aresolve(qwen3, messages, tools, chat_template=TEMPLATE)
            assert r.specprefill_system_end == expected_end(qwen3, i)
        elapsed = time.perf_counter() - started
        assert store.breaker.state == OPEN
        assert store.errors == 1   # one timeout, then the breaker keeps every request off Redis
        assert elapsed < 5.0       # bounded by one 50 ms timeout, not 30 of them (plus renders)
    finally:
        redis.resume()


def test_resumed_redis_is_used_again(qwen3, redis) -> None:
    clock = Clock()
    store = RedisStore(redis.url, timeout_seconds=0.05,
                       breaker=CircuitBreaker(ExponentialBackoff(1.0, 8.0), timer=clock))
    cache = StaticPrefixCache(store)
    redis.pause()
    messages, tools = request(0)
    cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE)
    redis.resume()
    assert store.breaker.state == OPEN
    clock.now += 1.0
    cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE)
    assert store.breaker.state == CLOSED
    assert cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE).hit


@pytest.mark.parametrize("damage", ["random", "truncated", "other_version", "empty"])
def test_damaged_entry_is_detected_recomputed_and_replaced(qwen3, redis, damage) -> None:
    store = RedisStore(redis.url)
    cache = StaticPrefixCache(store)
    messages, tools = request(1)
    good = cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE)
    client = redis.client()
    value = client.get(good.key)
    bad = {
        "random": random.Random(7).randbytes(len(value)),
        "truncated": value[:-5],
        "other_version": value[:4] + bytes([VERSION + 1]) + value[5:],
        "empty": b"",
    }[damage]
    client.set(good.key, bad)
    again = cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE)
    assert again.cache == "miss" and again.specprefill_system_end == good.specprefill_system_end
    assert cache.stats.snapshot()["verification_failures"] == 1
    assert client.get(good.key)[:5] == value[:5]  # a valid entry is back
    assert cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE).hit


def test_maxmemory_noeviction_puts_fail_quietly(qwen3, redis) -> None:
    store = RedisStore(redis.url)
    cache = StaticPrefixCache(store)
    used = int(redis.cli("info", "memory").split("used_memory:")[1].split()[0])
    redis.cli("config", "set", "maxmemory-policy", "noeviction")
    redis.cli("config", "set", "maxmemory", str(used + 1024))
    client = redis.client()
    try:
        client.set("filler", b"x" * 4096)
    except Exception:
        pass
    for i in range(6):
        messages, tools = request(i)
        r = cache.resolve(qwen3, messages, tools, chat_template=TEMPLATE)
        assert r.specprefill_system_end == expected_end(qwen3, i)
    snap = cache.stats.snapshot()
    assert snap["store_errors"] >= 3 and snap["hits"] == 0
    assert store.breaker.state == CLOSED  # Redis answered (OOM): it is up, just full
    redis.cli("config", "set", "maxmemory", "0")


def test_second_process_hits_what_the_first_computed(redis, tmp_path) -> None:
    from prefix_cache.model_folders.demo import demo_model_dir

    model = demo_model_dir(tmp_path / "models")
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"messages": [{"role": "system", "content": "Shared prompt."},
                                            {"role": "user", "content": "hi"}],
                               "tools": make_tools(8)}))
    cmd = [sys.executable, "-m", "prefix_cache.cli", "boundary", "--model", str(model),
           "--request", str(req), "--redis", redis.url]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=True)
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=True)
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert (a["cache"], b["cache"]) == ("miss", "hit")
    assert a["specprefill_system_end"] == b["specprefill_system_end"] > 0 and a["key"] == b["key"]


def test_cli_with_dead_redis_still_answers(tmp_path) -> None:
    from prefix_cache.model_folders.demo import demo_model_dir

    from tests.support.loopback import free_port

    model = demo_model_dir(tmp_path / "models")
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"messages": [{"role": "system", "content": "S"},
                                            {"role": "user", "content": "hi"}]}))
    proc = subprocess.run([sys.executable, "-m", "prefix_cache.cli", "boundary", "--model", str(model),
                           "--request", str(req), "--redis", f"redis://127.0.0.1:{free_port()}/0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cache"] == "miss"

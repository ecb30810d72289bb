"""Per-tenant rates (issue 40, part 4): ``requests_per_minute`` and ``tokens_per_minute`` in
``tenant_limits``, a 429 with ``Retry-After`` when spent; shared across replicas through a real
Redis with ``--redis``, per worker without; a Redis that dies costs exactness, not answers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from prefix_cache.service.rate_limits import WINDOW_S
from prefix_cache.service.upstream import Upstream
from tests.support.loopback import local_client
from tests.support.recording_upstream import Recorder
from tests.support.server_thread import ServerThread
from tests.support.sidecar import bearer, served, sidecar_app, unique_system

ACME, GLOBEX = "sk-rl-acme", "sk-rl-globex"
KEYS = {"tenants": {ACME: "acme", GLOBEX: "globex"},
        "tenant_limits": {"acme": {"requests_per_minute": 3},
                          "globex": {"tokens_per_minute": 40}}}
ROOM_S = 20.0  # what a test needs of the current minute window


def fresh_minute() -> None:
    """Wait, if need be, until the current minute has ``ROOM_S`` left: a test's requests
    fall in one window."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < ROOM_S:
        time.sleep(left + 0.05)


@contextmanager
def replicas(n: int, keys: Path, upstream: str, tokenizer: Any,
             **settings: Any) -> Iterator[list[httpx.Client]]:
    """``n`` sidecars of one configuration on real uvicorn, a client of each."""
    with ExitStack() as stack:
        clients = []
        for _ in range(n):
            app = sidecar_app(served("demo", tokenizer, Upstream(upstream)), keys_file=keys,
                              **settings)
            url = stack.enter_context(ServerThread(app))
            clients.append(stack.enter_context(local_client(base_url=url)))
        yield clients


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return path


def boundary(client: httpx.Client, key: str) -> httpx.Response:
    return client.post("/v1/prefix/boundary", headers=bearer(key), json={
        "model": "demo", "messages": [unique_system(), {"role": "user", "content": "hi"}]})


def chat(client: httpx.Client, key: str, words: int) -> httpx.Response:
    return client.post("/v1/chat/completions", headers=bearer(key), json={
        "model": "demo", "messages": [unique_system(), {"role": "user",
                                                        "content": "word " * words}]})


def assert_spent(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == code
    assert 1 <= int(r.headers["retry-after"]) <= WINDOW_S


def test_requests_per_minute_hold_across_replicas_through_redis(
        tmp_path: Path, redis: Any, recorder_server: tuple[Recorder, str],
        demo_tokenizer: Any) -> None:
    fresh_minute()
    with replicas(2, keys_file(tmp_path), recorder_server[1], demo_tokenizer,
                  redis_url=redis.url) as (a, b):
        assert [boundary(c, ACME).status_code for c in (a, a, b)] == [200, 200, 200]
        assert_spent(boundary(b, ACME), "tenant_requests_per_minute")
        assert_spent(boundary(a, ACME), "tenant_requests_per_minute")
        assert boundary(a, GLOBEX).status_code == 200  # another tenant: its own minute
    assert redis.cli("--scan", "--pattern", "prefix-cache:rate:acme:requests:*").strip()


def test_tokens_per_minute_count_prompt_tokens_across_replicas(
        tmp_path: Path, redis: Any, recorder_server: tuple[Recorder, str],
        demo_tokenizer: Any) -> None:
    fresh_minute()
    with replicas(2, keys_file(tmp_path), recorder_server[1], demo_tokenizer,
                  redis_url=redis.url) as (a, b):
        assert chat(a, GLOBEX, words=60).status_code == 200   # crosses the 40 tokens: runs
        assert_spent(chat(b, GLOBEX, words=1), "tenant_tokens_per_minute")
        assert chat(b, ACME, words=60).status_code == 200     # no token limit of its own


def test_without_redis_each_worker_counts_its_own(
        tmp_path: Path, recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> None:
    fresh_minute()
    with replicas(2, keys_file(tmp_path), recorder_server[1], demo_tokenizer) as (a, b):
        assert [boundary(a, ACME).status_code for _ in range(3)] == [200] * 3
        assert_spent(boundary(a, ACME), "tenant_requests_per_minute")
        assert boundary(b, ACME).status_code == 200  # the other worker's own minute


def test_a_dead_redis_costs_exactness_not_answers(
        tmp_path: Path, redis: Any, recorder_server: tuple[Recorder, str],
        demo_tokenizer: Any) -> None:
    fresh_minute()
    with replicas(1, keys_file(tmp_path), recorder_server[1], demo_tokenizer,
                  redis_url=redis.url) as (a,):
        assert boundary(a, ACME).status_code == 200
        redis.kill()
        # Counted in this worker from now on (its own count has the first request too):
        # still limited, never an error.
        assert [boundary(a, ACME).status_code for _ in range(2)] == [200, 200]
        assert_spent(boundary(a, ACME), "tenant_requests_per_minute")

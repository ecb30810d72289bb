"""Faults under load, on a real uvicorn with a real redis-server and a recording upstream: Redis
killed, hung and restarted; the upstream slow, failing and dead; clients leaving mid-stream.

Throughout: every answer has the exact boundary, no error reaches a client beyond what the
upstream itself returned, and afterwards nothing is left behind (tasks on the sidecar's loop,
streams upstream, connections beyond the pools' bounds). (A worker killed under load, with
``--workers 2``: tests/service/test_multiprocess_metrics.py.)
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from prefix_cache.service.upstream import Upstream
from prefix_cache.store.breaker import CircuitBreaker, ExponentialBackoff

from tests.support.load_client import (
    Agent,
    LoadThread,
    Truth,
    loop_of,
    make_agents,
    report,
    tasks_on,
    tcp_connections,
    wait_for_tasks,
)
from tests.support.loopback import free_port
from tests.support.recording_upstream import Recorder
from tests.support.redis_server import RedisServer, needs_redis
from tests.support.server_thread import ServerThread
from tests.support.sidecar import served, sidecar_app
from tests.support.waits import wait_until

pytestmark = needs_redis

PHASE_REQUESTS = 24      # answers to wait for in each phase of a fault sequence
SLACK_TASKS = 2          # tasks the loop may run beyond its idle count (a timer, a probe)
UPSTREAM_ERROR = ('{"error": {"message": "the engine is overloaded", "type": "server_error", '
                  '"code": "overloaded"}}')


@pytest.fixture
def truth(demo_tokenizer: Any) -> Truth:
    return Truth(demo_tokenizer)


def sidecar(redis: RedisServer, recorder_url: str, tokenizer: Any) -> Any:
    # A connection set-up timeout as short as the answer timeout: the probe windows below are
    # shorter than the default 1 s set-up, and each phase lasts about a second.
    app = sidecar_app(served("rec", tokenizer, Upstream(recorder_url)),
                      served("dead", tokenizer, Upstream(f"http://127.0.0.1:{free_port()}")),
                      redis_url=redis.url, ready_timeout_s=1.0, redis_connect_timeout_s=0.05)
    tiered = app.state.service.store.inner
    # Short probe windows, so a restarted Redis is used again within the test's phases, and a
    # memory tier that forgets at once, so every lookup goes to Redis.
    tiered.remote.breaker = CircuitBreaker(ExponentialBackoff(0.2, 0.4))
    tiered.local_ttl_seconds = 0.001
    return app


def warm_then_idle_tasks(server: ServerThread, base: str, truth: Truth) -> int:
    """Warm the sidecar (tokenizer, template, connections), then count its loop's idle tasks."""
    with LoadThread(base, make_agents(2, "warm"), truth, clients=2, limit=6) as load:
        load.wait_for(6)
    time.sleep(0.3)
    return tasks_on(loop_of(server))


def test_redis_killed_hung_and_restarted_under_load(redis: RedisServer, recorder_server: Any,
                                                    recorder: Recorder, demo_tokenizer: Any,
                                                    truth: Truth) -> None:
    app = sidecar(redis, recorder_server[1], demo_tokenizer)
    remote = app.state.service.store.inner.remote
    server = ServerThread(app)
    with server as base:
        idle = warm_then_idle_tasks(server, base, truth)
        with LoadThread(base, make_agents(12, "redis"), truth, clients=8) as load:
            load.wait_for(PHASE_REQUESTS)
            redis.kill()
            load.wait_for(PHASE_REQUESTS)
            redis.start()
            load.wait_for(PHASE_REQUESTS)
            redis.pause()
            try:
                load.wait_for(PHASE_REQUESTS)
            finally:
                redis.resume()
            load.wait_for(PHASE_REQUESTS)
            hits_before = load.tally.caches["hit"]
            load.wait_for(PHASE_REQUESTS)
            # The breaker's next probe window ends at its own pace: wait for hits (bounded),
            # not for a fixed number of requests.
            wait_until(lambda: load.tally.caches["hit"] > hits_before, "hits to resume",
                       timeout=30.0, interval=0.05)
            tally = load.stop()
        tasks = wait_for_tasks(loop_of(server), idle + SLACK_TASKS)
        connections = tcp_connections(os.getpid(), port_of(redis.url))
        report("redis_killed_hung_restarted", tally, breaker_opened=remote.breaker.times_opened,
               store_errors=remote.errors, idle_tasks=idle, tasks_after=tasks,
               redis_connections=connections)
        assert tally.wrong == [] and tally.transport_errors == {}
        assert set(tally.statuses) == {200}, tally
        assert tally.caches["hit"] > hits_before        # hits resumed after the faults
        assert remote.breaker.times_opened >= 2         # both outages were seen as outages
        assert tasks <= idle + SLACK_TASKS
        # The sync pool and this loop's async pool, each within its bound.
        assert connections <= 2 * remote.client_options["max_connections"]
    assert recorder.streams_open == 0


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def upstream_mix(agent: Agent, turn: int) -> dict[str, Any]:
    """Requests to an upstream that is fine, slow, failing, dead, or dies mid-stream."""
    kind = turn % 5
    if kind == 0:
        return agent.body(turn, stream=True)
    if kind == 1:
        return agent.body(turn, recorder={"delay_s": 0.2})
    if kind == 2:
        return agent.body(turn, recorder={"mode": "error", "status": 500, "body": UPSTREAM_ERROR})
    if kind == 3:
        return agent.body(turn, model="dead")
    return agent.body(turn, stream=True, recorder={"mode": "break"})


def test_upstream_slow_failing_and_dead_under_load(redis: RedisServer, recorder_server: Any,
                                                   recorder: Recorder, demo_tokenizer: Any,
                                                   truth: Truth) -> None:
    app = sidecar(redis, recorder_server[1], demo_tokenizer)
    server = ServerThread(app)
    with server as base:
        idle = warm_then_idle_tasks(server, base, truth)
        with LoadThread(base, make_agents(10, "up"), truth, clients=8,
                        make_body=upstream_mix) as load:
            load.wait_for(5 * PHASE_REQUESTS)
            tally = load.stop()
        tasks = wait_for_tasks(loop_of(server), idle + SLACK_TASKS)
        connections = tcp_connections(os.getpid(), port_of(recorder_server[1]))
        report("upstream_slow_failing_dead", tally, error_codes=tally.bodies, idle_tasks=idle,
               tasks_after=tasks, upstream_connections=connections)
        assert tally.wrong == [] and tally.transport_errors == {}
        # Exactly what the upstream said (its 500 and its message), or that it was not there.
        assert set(tally.statuses) == {200, 500, 502}, tally
        assert tally.bodies == {500: {"overloaded"}, 502: {"upstream_unavailable"}}
        assert tasks <= idle + SLACK_TASKS
        assert connections <= 64  # the upstream client's keep-alive bound
    assert recorder.streams_open == 0


def test_clients_leaving_mid_stream_cancel_everything(redis: RedisServer, recorder_server: Any,
                                                      recorder: Recorder, demo_tokenizer: Any,
                                                      truth: Truth) -> None:
    app = sidecar(redis, recorder_server[1], demo_tokenizer)
    agents = make_agents(6, "leave")
    server = ServerThread(app)
    with server as base:
        idle = warm_then_idle_tasks(server, base, truth)

        async def leave_after_first_chunk(client: Any, agent: Agent, turn: int) -> int:
            # The upstream sends one chunk, then would wait 15 s: only a cancel ends it sooner.
            body = agent.body(turn, stream=True, recorder={"mode": "hang"})
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert int(r.headers["x-specprefill-system-end"]) == truth(agent, turn)
                async for _ in r.aiter_raw():
                    break
            return r.status_code

        async def clients() -> list[int]:
            import httpx

            limits = httpx.Limits(max_connections=8)
            async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=30.0,
                                         limits=limits) as client:
                sem = asyncio.Semaphore(8)

                async def one(i: int) -> int:
                    async with sem:
                        return await leave_after_first_chunk(client, agents[i % 6], i)
                return await asyncio.gather(*(one(i) for i in range(40)))

        # Meanwhile other clients stream to the end, and get every answer right.
        with LoadThread(base, agents, truth, clients=2,
                        make_body=lambda a, t: a.body(t, stream=True)) as load:
            assert asyncio.run(clients()) == [200] * 40
            tally = load.stop()
        deadline = time.monotonic() + 5.0   # well before the upstream's own 15 s
        while recorder.streams_open and time.monotonic() < deadline:
            time.sleep(0.05)
        tasks = wait_for_tasks(loop_of(server), idle + SLACK_TASKS)
        report("clients_leaving_mid_stream", tally, left_mid_stream=40,
               upstream_streams_open_after=recorder.streams_open, idle_tasks=idle,
               tasks_after=tasks)
        assert tally.wrong == [] and set(tally.statuses) == {200}
        assert recorder.streams_open == 0
        assert tasks <= idle + SLACK_TASKS

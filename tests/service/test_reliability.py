"""The sidecar with a real Redis in trouble: a big admin purge keeps the worker responsive, a purge
in an outage is a 503 that changes nothing, /readyz and the dashboard tell the truth about Redis
at once. Real uvicorn, real redis-server, a real HTTP client."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import httpx
import pytest

from prefix_cache.service import ServiceSettings, create_app
from prefix_cache.service.served_models import ModelRegistry
from prefix_cache.store.breaker import CircuitBreaker, ExponentialBackoff

from tests.support.loopback import local_client
from tests.support.redis_server import RedisServer, needs_redis
from tests.support.server_thread import ServerThread
from tests.support.sidecar import bearer, served, unique_system
from tests.support.tools import make_tools
from tests.support.waits import wait_until

pytestmark = needs_redis

ACME, ADMIN = "sk-acme-1", "sk-admin-1"
BOUNDED_S = 30.0      # the longest any wait here may take; never a timing assertion
PURGED_KEYS = 150_000


@pytest.fixture
def models(demo_tokenizer: Any) -> ModelRegistry:
    return ModelRegistry([served("demo", demo_tokenizer)])


def sidecar(redis: RedisServer, models: ModelRegistry, **settings: Any) -> Any:
    return create_app(ServiceSettings(redis_url=redis.url, api_keys={ACME: "acme"},
                                      admin_keys=[ADMIN], ready_timeout_s=1.0, **settings),
                      models=models)


def boundary(http: httpx.Client, system: dict[str, str]) -> httpx.Response:
    return http.post("/v1/prefix/boundary", headers=bearer(ACME), json={
        "model": "demo", "messages": [system, {"role": "user", "content": "Hi"}],
        "tools": make_tools(2)})


def remote_of(app: Any) -> Any:
    """The app's RedisStore (under its tenant quotas and memory tier)."""
    return app.state.service.store.inner.remote


def fill(redis: RedisServer, prefix: str, n: int) -> None:
    """n keys under ``prefix``, written by the server itself (fast, whatever the client)."""
    script = "for i = 1, tonumber(ARGV[2]) do redis.call('SET', ARGV[1] .. i, 'x') end return 1"
    for start in range(0, n, 50_000):
        redis.cli("eval", script, "0", f"{prefix}{start}:", str(min(50_000, n - start)))


def left_after_purge(redis: RedisServer, tenant: str) -> list[str]:
    """Every key in Redis but the tenant's purge fence: the one key a purge writes (the stored
    responses' purge counter, which refuses a response still in flight when it answered)."""
    from prefix_cache.chat.responses_store import SharedResponses

    keys = redis.cli("--scan").split()
    fence = SharedResponses.purged_key(tenant)
    assert fence in keys, keys
    return sorted(k for k in keys if k != fence)


# -- 2. a large purge never stalls the worker -----------------------------------------------


def test_a_large_purge_leaves_the_event_loop_serving(redis: RedisServer, models: Any) -> None:
    fill(redis, "spc:acme:demo:", PURGED_KEYS)
    app = sidecar(redis, models)
    with ServerThread(app) as base, local_client(base_url=base) as http:
        baseline = []
        for _ in range(20):
            started = time.monotonic()
            assert http.get("/healthz").status_code == 200
            baseline.append(time.monotonic() - started)
        window: dict[str, Any] = {}

        def purge() -> None:
            with local_client(base_url=base, timeout=BOUNDED_S * 4) as admin:
                window["start"] = time.monotonic()
                window["response"] = admin.post("/admin/purge", headers=bearer(ADMIN),
                                                json={"tenant": "acme"})
                window["end"] = time.monotonic()

        purger = threading.Thread(target=purge)
        purger.start()
        beats: list[tuple[float, float]] = []   # (sent, answered) of each /healthz
        while purger.is_alive():
            sent = time.monotonic()
            assert http.get("/healthz").status_code == 200
            beats.append((sent, time.monotonic()))
            time.sleep(0.005)
        purger.join()
    assert window["response"].status_code == 200, window["response"].text
    assert window["response"].json()["purged"] == PURGED_KEYS
    assert left_after_purge(redis, "acme") == []
    duration = window["end"] - window["start"]
    answered = [a for _, a in beats if window["start"] < a < window["end"]]
    worst = max(a - s for s, a in beats if window["start"] < s < window["end"])
    # A blocked loop answers nothing until the purge ends: no beat answered inside the window,
    # and the first one sent in it waits for (nearly) the whole purge. Bounds are generous and
    # relative (to the purge, to this run's idle /healthz), never absolute.
    # Answers all through it: at least one per 100 ms of purge (five for a purge that long).
    assert len(answered) >= min(5, max(2, int(duration / 0.1))), (len(answered), duration)
    assert worst < max(duration / 2, 50 * statistics.median(baseline)), (worst, duration)


# -- 11c. a purge in an outage is a 503, and changes nothing ---------------------------------


def test_a_purge_during_a_redis_outage_is_a_503_that_changes_nothing(redis: RedisServer,
                                                                     models: Any) -> None:
    app = sidecar(redis, models)
    state = app.state.service
    memory = state.store.inner.local
    with ServerThread(app) as base, local_client(base_url=base) as http:
        for i in range(3):
            assert boundary(http, unique_system(f"purge{i}")).json()["cache"] == "miss"
        kept = set(memory.keys())
        assert len(kept) == 3 and state.store.tenant_usage()["acme"]["entries"] == 3
        redis.pause()
        try:
            r = http.post("/admin/purge", headers=bearer(ADMIN), json={"tenant": "acme"})
        finally:
            redis.resume()
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "store_unavailable" and "store" in error["message"]
        assert r.headers["retry-after"]
        assert set(memory.keys()) == kept                              # nothing cleared
        assert state.store.tenant_usage()["acme"]["entries"] == 3      # the books kept
        assert len(redis.cli("--scan", "--pattern", "spc:acme:*").split()) == 3
        # Once Redis answers again (the breaker's window passes), the purge goes through whole.
        wait_until(lambda: http.post("/admin/purge", headers=bearer(ADMIN),
                                     json={"tenant": "acme"}).status_code == 200, "the purge",
                   timeout=BOUNDED_S)
        assert memory.keys() == [] and left_after_purge(redis, "acme") == []
        assert state.store.tenant_usage()["acme"]["entries"] == 0


# -- 4. /readyz and the dashboard follow Redis itself -----------------------------------------


def test_readyz_and_dashboard_follow_redis_not_the_breaker(redis: RedisServer, models: Any) -> None:
    app = sidecar(redis, models)
    # A breaker that, once open, stays open a full minute: only a direct ping can see Redis back.
    remote_of(app).breaker = CircuitBreaker(ExponentialBackoff(60.0, 60.0))
    with ServerThread(app) as base, local_client(base_url=base) as http:
        def reachable() -> bool:
            stats = http.get("/dashboard/stats.json", headers=bearer(ADMIN)).json()
            return bool(stats["store_health"]["reachable"])

        assert http.get("/readyz").status_code == 200 and reachable()
        redis.kill()
        # Down, before any request noticed: the breaker is still closed, the truth is not.
        assert not reachable()
        r = http.get("/readyz", headers=bearer(ADMIN))
        assert r.status_code == 503 and r.json()["store"]["ok"] is False
        assert boundary(http, unique_system("outage")).status_code == 200  # computed instead
        assert remote_of(app).breaker.state == "open"
        redis.start()
        # Back: ready at once, although the breaker keeps requests off Redis for its window.
        wait_until(lambda: http.get("/readyz").status_code == 200, "/readyz to see Redis",
                   timeout=5.0)
        assert reachable() and remote_of(app).breaker.state == "open"

"""Stalled, killed and restarted replicas: two real ``serve-engine`` processes (the tiny model)
behind a real sidecar. A replica stopped with SIGSTOP is failed over once it sends no first
byte in time and fails its health check; one killed with streams in flight is ejected once,
not once per stream; background health probes route to a restarted one within an interval."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")

from prefix_cache.cache.keys import model_label  # noqa: E402
from prefix_cache.model_folders.model_dir import load_tokenizer  # noqa: E402
from prefix_cache.service.pool import UpstreamPool  # noqa: E402
from prefix_cache.service.served_models import ServedModel  # noqa: E402
from prefix_cache.service.upstream import Upstream  # noqa: E402
from tests.support.loopback import local_client  # noqa: E402
from tests.support.serve_process import EngineProcess  # noqa: E402
from tests.support.server_thread import ServerThread  # noqa: E402
from tests.support.sidecar import sidecar_app  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

MODEL = "tiny"
EJECT_S = 120.0          # long: only a health probe brings a replica back within the test
FIRST_BYTE_S = 1.0
CLIENT_TIMEOUT_S = 60.0  # far below the 600 s upstream timeout a stalled replica used to cost


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[list[EngineProcess]]:
    logs = tmp_path_factory.mktemp("engine-logs")
    made = [EngineProcess(tiny_model_dir, logs, "--engine-option", "kv_disk_bytes=0")
            for _ in range(2)]
    try:
        for engine in made:
            engine.start()
        yield made
    finally:
        for engine in made:
            engine.stop()


@pytest.fixture
def sidecar_for(engines: list[EngineProcess], tiny_model_dir: Path) -> Iterator[Any]:
    opened: list[ServerThread] = []
    tokenizer = load_tokenizer(tiny_model_dir)

    def start(probe_interval_s: float) -> tuple[str, UpstreamPool]:
        upstreams = [Upstream(e.url, "specprefill") for e in engines]
        pool = UpstreamPool(upstreams, eject_s=EJECT_S)
        model = ServedModel(MODEL, model_label(MODEL), tokenizer, upstreams[0], pool=pool)
        app = sidecar_app(model, upstream_first_byte_s=FIRST_BYTE_S, ready_timeout_s=0.5,
                          upstream_probe_interval_s=probe_interval_s)
        server = ServerThread(app, log_level="critical")
        opened.append(server)
        return server.__enter__(), pool

    yield start
    for server in opened:
        server.__exit__(None, None, None)
    for engine in engines:  # whatever a test did to them, both are up for the next
        engine.signal(signal.SIGCONT)
        if engine.proc is None or engine.proc.poll() is not None:
            engine.start()


def body(agent: str, stream: bool = False, max_tokens: int = 2) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
            "messages": [{"role": "system", "content": f"You are agent {agent}."},
                         {"role": "user", "content": uuid.uuid4().hex}]}


def requests(pool: UpstreamPool) -> list[int]:
    return [row["requests"] for row in pool.snapshot()]


def home_of(url: str, pool: UpstreamPool, agent: str) -> int:
    """The replica an agent's turns go to (its static prefix's home)."""
    before = requests(pool)
    with local_client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        assert http.post("/v1/chat/completions", json=body(agent)).status_code == 200
    moved = [i for i, (a, b) in enumerate(zip(before, requests(pool), strict=True)) if b > a]
    assert len(moved) == 1
    return moved[0]


def ejected(pool: UpstreamPool, replica: int) -> bool:
    return bool(pool.snapshot()[replica]["ejected"])


def test_a_stalled_replica_is_failed_over_before_the_first_byte(
        sidecar_for: Any, engines: list[EngineProcess]) -> None:
    url, pool = sidecar_for(probe_interval_s=3600.0)  # no background probe: the request's own
    agent = uuid.uuid4().hex
    home = home_of(url, pool, agent)
    engines[home].signal(signal.SIGSTOP)
    with local_client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        with http.stream("POST", "/v1/chat/completions", json=body(agent, stream=True)) as r:
            text = b"".join(r.iter_raw())
    assert r.status_code == 200 and b"[DONE]" in text
    assert ejected(pool, home) and not ejected(pool, 1 - home)
    assert pool.snapshot()[1 - home]["choices"]["failover"] == 1


def test_a_stalled_replica_comes_back_within_a_probe_interval(
        sidecar_for: Any, engines: list[EngineProcess]) -> None:
    interval = 0.5
    url, pool = sidecar_for(probe_interval_s=interval)
    agent = uuid.uuid4().hex
    home = home_of(url, pool, agent)
    engines[home].signal(signal.SIGSTOP)
    wait_until(lambda: ejected(pool, home), "the background probe to eject the stalled replica")
    assert home_of(url, pool, agent) == 1 - home  # routed around it, no wait
    engines[home].signal(signal.SIGCONT)
    # Back within an interval (and a probe's timeout), though its backoff has minutes to run.
    wait_until(lambda: not ejected(pool, home), "the probe to bring the replica back",
               timeout=10 * interval)
    assert home_of(url, pool, agent) == home


def test_a_kill_with_streams_in_flight_ejects_once_and_a_restart_is_routed_to_again(
        sidecar_for: Any, engines: list[EngineProcess]) -> None:
    interval = 0.5
    url, pool = sidecar_for(probe_interval_s=interval)
    agent = uuid.uuid4().hex
    home = home_of(url, pool, agent)
    with local_client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        streams = [http.stream("POST", "/v1/chat/completions",
                               json=body(agent, stream=True, max_tokens=4000))
                   for _ in range(3)]
        opened = [s.__enter__() for s in streams]
        chunks = [r.iter_raw() for r in opened]
        for c in chunks:
            next(c)  # each stream has started on the home replica
        engines[home].kill()
        tails = [b"".join(c) for c in chunks]
        for s in streams:
            s.__exit__(None, None, None)
    assert all(b"error" in tail for tail in tails)  # each ends in an error event
    # The sidecar records a stream's failure after the error event went out: wait for it.
    wait_until(lambda: ejected(pool, home), "the killed replica ejected", timeout=10 * interval)
    assert pool.snapshot()[home]["ejections"] == 1  # one outage, one ejection
    engines[home].start()
    started = time.monotonic()
    wait_until(lambda: not ejected(pool, home), "the probe to route to the restarted replica",
               timeout=10 * interval)
    assert time.monotonic() - started < EJECT_S  # its backoff did not decide
    assert home_of(url, pool, agent) == home

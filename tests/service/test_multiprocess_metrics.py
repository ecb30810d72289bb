"""``prefix-cache serve --workers 2`` with ``PROMETHEUS_MULTIPROC_DIR``: what an earlier run left
in the folder is not counted, and a worker killed under load leaves the sums while requests go
on (uvicorn starts another)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.support.load_client import LoadThread, Truth, make_agents, report
from tests.support.loopback import local_client
from tests.support.paths import REPO
from tests.support.redis_server import RedisServer, needs_redis
from tests.support.serve_process import ServeProcess
from tests.support.waits import wait_until

pytestmark = needs_redis

BOUNDED_S = 60.0
DEMO = "demo-qwen3"   # the model `serve` serves when given none
LOAD_CLIENTS = 4


def samples(text: str, name: str) -> float:
    """The sum of a metric's samples in an exposition."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


def process_entries(folder: Path, pid: int, scratch: Path) -> float:
    """``store_entries`` as one process's own files say (read apart from the others)."""
    from prometheus_client import multiprocess

    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir()
    for file in folder.glob(f"*_{pid}.db"):
        shutil.copy(file, scratch)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(scratch))
    return sum(s.value for fam in registry.collect() for s in fam.samples
               if s.name == "prefix_cache_store_entries")


def live_gauge_pids(folder: Path) -> set[int]:
    return {int(f.stem.rsplit("_", 1)[1]) for f in folder.glob("gauge_live*_*.db")}


def children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def leave_an_earlier_run(folder: Path) -> None:
    """What a worker of an earlier run leaves when it is killed: its breaker open, its counts."""
    code = textwrap.dedent("""
        from prefix_cache.metrics import Metrics
        m = Metrics()
        m.breaker_open.set(1)
        for _ in range(1000):
            m.resolved(cache="hit", namespace="default", model="m", seconds=0.001,
                       static_tokens=10, boundary=10)
        """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True, timeout=60)


def test_two_workers_one_killed_under_load(tmp_path: Path, redis: RedisServer, demo_folder: Path,
                                           demo_tokenizer: Any, recorder_server: Any) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    leave_an_earlier_run(folder)
    serve = ServeProcess(["--workers", "2", "--redis", redis.url, "--upstream", recorder_server[1]],
                         demo_folder.parent, env={"PROMETHEUS_MULTIPROC_DIR": str(folder)})
    try:
        base = serve.base_url()
        with local_client(base_url=base) as http:
            text = http.get("/metrics").text
            assert samples(text, "prefix_cache_circuit_breaker_open") == 0   # not the old run's
            assert samples(text, "prefix_cache_requests_total") == 0
            wait_until(lambda: len(live_gauge_pids(folder) & children(serve.proc.pid)) == 2,
                       "both workers' gauges", timeout=BOUNDED_S, interval=0.1)
            truth = Truth(demo_tokenizer)
            agents = make_agents(16, "mp")
            # New connections each time, so both workers take requests.
            with LoadThread(base, agents, truth, clients=LOAD_CLIENTS, fresh_connections=True,
                            make_body=lambda agent, turn: agent.body(turn, model=DEMO)) as load:
                load.wait_for(48)
                workers = sorted(live_gauge_pids(folder) & children(serve.proc.pid))
                wait_until(lambda: all(process_entries(folder, p, tmp_path / "one") > 0
                                       for p in workers), "entries in both workers",
                           timeout=BOUNDED_S, interval=0.1)
                victim = max(workers, key=lambda p: process_entries(folder, p, tmp_path / "one"))
                killed_entries = process_entries(folder, victim, tmp_path / "one")
                os.kill(victim, signal.SIGKILL)
                load.wait_for(48)  # served on: by the other worker, then by uvicorn's new one
                tally = load.stop()
            report("worker_killed", tally, workers=2, killed_worker_entries=killed_entries)
            assert tally.wrong == [] and set(tally.statuses) == {200}, tally
            # Only requests in flight on the killed worker can have failed, and only there.
            assert sum(tally.transport_errors.values()) <= LOAD_CLIENTS, tally
            # uvicorn's supervisor reaps the killed worker on its next check (later on a busy
            # machine): bounded, not at once.
            wait_until(lambda: victim not in children(serve.proc.pid), "the killed worker reaped",
                       timeout=BOUNDED_S, interval=0.1)

            def forgotten() -> bool:
                text = http.get("/metrics").text   # any worker answers; the scrape forgets the dead
                live = sorted(live_gauge_pids(folder) & children(serve.proc.pid))
                expected = sum(process_entries(folder, p, tmp_path / "one") for p in live)
                return (victim not in live_gauge_pids(folder)
                        and samples(text, "prefix_cache_store_entries") == expected)
            wait_until(forgotten, "the killed worker to leave the sums", timeout=BOUNDED_S,
                       interval=0.1)
    finally:
        serve.stop()

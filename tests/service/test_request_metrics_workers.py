"""``prefix-cache serve --workers 2`` (issue 40): the request metrics and the dashboard's history
are every worker's, whichever worker answers the scrape or the page."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.support.loopback import local_client
from tests.support.recording_upstream import Recorder
from tests.support.serve_process import ServeProcess
from tests.support.sidecar import unique_system

WORKERS = 2
CHATS = 12
READS = 6  # on fresh connections: each lands on whichever worker accepts it
INTERVAL_S = 10


def fresh(url: str, method: str, path: str, **kwargs: object) -> object:
    with local_client(base_url=url) as client:
        r = client.request(method, path, **kwargs)  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    return r


def test_every_worker_answers_with_every_workers_requests(
        tmp_path: Path, recorder_server: tuple[Recorder, str]) -> None:
    folder = tmp_path / "prom"
    server = ServeProcess(["--workers", str(WORKERS), "--upstream", recorder_server[1]],
                          tmp_path / "home", env={"PROMETHEUS_MULTIPROC_DIR": str(folder)})
    try:
        url = server.base_url()
        for _ in range(WORKERS):
            server.wait_for("Application startup complete", timeout=60)
        system = unique_system()
        for i in range(CHATS):
            fresh(url, "POST", "/v1/chat/completions", json={
                "model": "demo-qwen3", "messages": [system, {"role": "user", "content": f"{i}"}]})
        for _ in range(READS):
            text = fresh(url, "GET", "/metrics").text  # type: ignore[attr-defined]
            counts = {s.labels["cache"]: s.value for f in text_string_to_metric_families(text)
                      for s in f.samples if s.name == "prefix_cache_http_requests_total"}
            # Each worker has its own memory store: a miss in each worker that was asked.
            assert sum(counts.values()) == CHATS and 1 <= counts["miss"] <= WORKERS
        # Once the interval closed and each worker wrote its ring (every 2 s): the whole count.
        time.sleep(INTERVAL_S - time.time() % INTERVAL_S + 2.5)
        for _ in range(READS):
            doc = fresh(url, "GET", "/dashboard/history.json?seconds=300").json()  # type: ignore[attr-defined]
            assert doc["interval_s"] == INTERVAL_S
            closed = doc["series"]["api_requests_per_s"][:-1]
            assert round(sum(v * INTERVAL_S for _, v in closed)) == CHATS
            computed = doc["series"]["prompt_tokens_computed_per_s"][:-1]
            # The recorder's usage: one prompt token each.
            assert round(sum(v * INTERVAL_S for _, v in computed)) == CHATS
        assert len(list(folder.glob("history_*.json"))) >= 1
    finally:
        server.stop()

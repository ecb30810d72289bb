"""Tenants managed live (issue 40, part 4): the keys file re-read on SIGHUP in every worker of
``prefix-cache serve --workers 2``, while requests keep being answered; a removed key refused
at once, a new one served; a bad file refused with a log line, the old keys kept. Issue 47,
defect 1: a file cut short (``tenants:`` and nothing more) would open the service; it is
refused and counted, the service stays locked."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

from tests.support.loopback import local_client
from tests.support.serve_process import ServeProcess
from tests.support.sidecar import bearer, unique_system, write_keys_file

OLD, STAY, NEW, ADMIN = "sk-hup-old", "sk-hup-stay", "sk-hup-new", "sk-hup-admin"
WORKERS = 2
TRIES = 12  # fresh connections per check: each lands on whichever worker accepts it


def status(url: str, key: str | None) -> int:
    """A boundary request on a connection of its own (no Authorization header: ``None``)."""
    with local_client(base_url=url) as client:
        return client.post("/v1/prefix/boundary", headers=bearer(key) if key else {}, json={
            "messages": [unique_system(), {"role": "user", "content": "hi"}]}).status_code


def metrics_status(url: str) -> int:
    """``GET /metrics`` with no key, on a connection of its own."""
    with local_client(base_url=url) as client:
        return client.get("/metrics").status_code


def reloads(url: str, result: str) -> float:
    """``prefix_cache_keys_reloads_total{result}`` of the worker that answers."""
    with local_client(base_url=url) as client:
        text = client.get("/metrics", headers=bearer(ADMIN)).text
    match = re.search(rf'^prefix_cache_keys_reloads_total{{result="{result}"}} (\S+)$', text,
                      re.MULTILINE)
    assert match, text
    return float(match.group(1))


def hup(server: ServeProcess, pattern: str) -> None:
    """SIGHUP to the supervisor; back once every worker logged ``pattern``."""
    os.kill(server.proc.pid, signal.SIGHUP)
    for _ in range(WORKERS):
        server.wait_for(pattern, timeout=30)


def test_sighup_rereads_the_keys_file_in_every_worker(tmp_path: Path) -> None:
    keys = write_keys_file(tmp_path / "keys.yaml", {OLD: "acme", STAY: "globex"}, [ADMIN])
    server = ServeProcess(["--workers", str(WORKERS)], tmp_path / "home",
                          env={"PREFIX_CACHE_KEYS_FILE": str(keys)})
    stop, seen = threading.Event(), []

    def load(url: str) -> None:  # a tenant whose key stays: served throughout, never refused
        while not stop.is_set():
            seen.append(status(url, STAY))

    try:
        url = server.base_url()
        for _ in range(WORKERS):  # both workers serve (the first may answer alone till then)
            server.wait_for("Application startup complete", timeout=60)
        assert {status(url, OLD) for _ in range(TRIES)} == {200}
        assert status(url, NEW) == 401
        loader = threading.Thread(target=load, args=(url,))
        loader.start()
        write_keys_file(keys, {NEW: "initech", STAY: "globex"}, [ADMIN])
        hup(server, r"keys file .* re-read: tenants \['globex', 'initech'\]")
        assert {status(url, OLD) for _ in range(TRIES)} == {401}
        assert {status(url, NEW) for _ in range(TRIES)} == {200}

        keys.write_text("tenants: [this is not a mapping\n")
        hup(server, r"keys file .* refused, the keys in use are kept")
        assert {status(url, NEW) for _ in range(TRIES)} == {200}
        assert {status(url, OLD) for _ in range(TRIES)} == {401}

        keys.write_text("tenants:\n")  # cut short: no tenant, no admin key (issue 47, 1)
        hup(server, r"keys file .* refused, the keys in use are kept: .* holds no key")
        assert {status(url, None) for _ in range(TRIES)} == {401}
        assert {metrics_status(url) for _ in range(TRIES)} == {401}
        assert {status(url, NEW) for _ in range(TRIES)} == {200}
        keys.write_text(f"admin_keys:\n  - {ADMIN}\n")  # the admin key alone: /v1 would open
        hup(server, r"keys file .* refused, the keys in use are kept: it would open /v1")
        assert {status(url, None) for _ in range(TRIES)} == {401}
        assert {status(url, NEW) for _ in range(TRIES)} == {200}
        # Whichever worker answers: each counts its own (no PROMETHEUS_MULTIPROC_DIR here).
        assert (reloads(url, "would_open"), reloads(url, "invalid"), reloads(url, "ok")
                ) == (1, 2, 1)
        stop.set()
        loader.join(timeout=30)
        assert seen and set(seen) == {200}
        assert "restarting processes" not in "".join(server.log)  # reloaded, not restarted
    finally:
        stop.set()
        server.stop()

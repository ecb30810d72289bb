"""A pool of upstream replicas behind one sidecar, on real HTTP: four recording upstreams
(``tests.support.service_helpers.recording_upstream``), each behind a switch that can take it down, and the
sidecar on a real uvicorn. Which replica answered is read from the replicas' own records."""

from __future__ import annotations

import argparse
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families

from prefix_cache.cache.keys import model_label
from prefix_cache.service import ServiceSettings
from prefix_cache.service.flags import add_serve_flags, flag_overrides
from prefix_cache.service.served_models import ServedModel, load_model_specs
from prefix_cache.service.pool import UpstreamPool
from prefix_cache.service.routing import affinity_order, routing_key
from prefix_cache.service.upstream import Upstream

from tests.support.browser import (
    CHROMEDRIVER,
    CHROMIUM,
    browser_errors,
    headless_chromium,
    wait_for_js,
)
from tests.support.loopback import free_port, local_client
from tests.support.paths import GRAFANA_DASHBOARD
from tests.support.recording_upstream import Recorder, recording_upstream
from tests.support.server_thread import ServerThread
from tests.support.sidecar import bearer, sidecar_app
from tests.support.waits import wait_until


REPLICAS = 4
EJECT_S = 0.3
MODEL = "pooled"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look it up.",
                                           "parameters": {"type": "object", "properties": {}}}}]


class Switch:
    """An ASGI wrapper that answers 503 to everything while ``down`` (a replica that fails)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.down = False
        self.refused = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.down:
            self.refused += 1
            body = {"error": {"message": "down", "type": "server_error", "code": "down"}}
            await JSONResponse(body, status_code=503)(scope, receive, send)
            return
        await self.app(scope, receive, send)


@dataclass
class Replicas:
    recorders: list[Recorder] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def which(self, tag: str) -> int | None:
        """The replica that received the request tagged ``tag``."""
        hits = [i for i, rec in enumerate(self.recorders)
                if any(r.body.get("tag") == tag for r in rec.requests)]
        assert len(hits) <= 1, f"request {tag} reached replicas {hits}"
        return hits[0] if hits else None

    def received(self) -> int:
        return sum(len(rec.requests) for rec in self.recorders)


@pytest.fixture(scope="module")
def replica_servers() -> Iterator[Replicas]:
    replicas = Replicas()
    servers = []
    for _ in range(REPLICAS):
        rec = Recorder()
        switch = Switch(recording_upstream(rec))
        server = ServerThread(switch, log_level="critical")
        replicas.recorders.append(rec)
        replicas.switches.append(switch)
        replicas.urls.append(server.__enter__() + "/v1")
        servers.append(server)
    yield replicas
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def replicas(replica_servers: Replicas) -> Replicas:
    for rec, switch in zip(replica_servers.recorders, replica_servers.switches, strict=True):
        rec.reset()
        switch.down = False
        switch.refused = 0
    return replica_servers


@dataclass
class Sidecar:
    base: str
    pool: UpstreamPool
    client: httpx.Client
    replicas: Replicas

    def ask(self, agent: int, turn: int = 0, key: str | None = None,
            **extra: Any) -> tuple[int, int | None]:
        """One turn of an agent (a static system prompt and tools of its own); the status
        and the replica that answered."""
        tag = uuid.uuid4().hex
        headers = bearer(key) if key else {}
        r = self.client.post(f"{self.base}/v1/chat/completions", headers=headers,
                             json={**chat_body(agent, turn), "tag": tag, **extra})
        return r.status_code, self.replicas.which(tag)

    def row(self, replica: int) -> dict[str, Any]:
        return self.pool.snapshot()[replica]


def chat_body(agent: int, turn: int) -> dict[str, Any]:
    return {"model": MODEL, "tools": TOOLS, "messages": [
        {"role": "system", "content": f"You are agent {agent}. Be brief."},
        {"role": "user", "content": f"turn {turn}"}]}


@pytest.fixture
def sidecar_for(replicas: Replicas, demo_tokenizer: Any) -> Iterator[Any]:
    opened: list[tuple[ServerThread, httpx.Client]] = []

    def start(urls: list[str] | None = None, policy: str | None = None,
              eject_s: float = EJECT_S, load_floor: int = 4, **settings: Any) -> Sidecar:
        upstreams = [Upstream(u) for u in (urls or replicas.urls)]
        pool = UpstreamPool(upstreams, policy, eject_s=eject_s, load_floor=load_floor)
        model = ServedModel(MODEL, model_label(MODEL), demo_tokenizer, upstreams[0], pool=pool)
        app = sidecar_app(model, **settings)
        server = ServerThread(app, log_level="critical")
        client = local_client()
        opened.append((server, client))
        return Sidecar(server.__enter__(), pool, client, replicas)

    yield start
    for server, client in opened:
        client.close()
        server.__exit__(None, None, None)


def test_the_same_key_goes_to_the_same_replica(sidecar_for: Any) -> None:
    sidecar = sidecar_for()
    homes = {}
    for agent in range(8):
        answers = [sidecar.ask(agent, turn) for turn in range(3)]
        assert {status for status, _ in answers} == {200}
        assert len({replica for _, replica in answers}) == 1, answers   # every turn, one home
        homes[agent] = answers[0][1]
    assert len(set(homes.values())) > 1            # and the agents are spread
    choices = [sidecar.row(i)["choices"] for i in range(REPLICAS)]
    assert sum(c["affinity"] for c in choices) == 24
    assert sum(c["spill"] + c["failover"] for c in choices) == 0


def test_the_load_bound_spills_to_the_next_replica_and_comes_back(sidecar_for: Any,
                                                                  replicas: Replicas) -> None:
    sidecar = sidecar_for(load_floor=1)            # the bound alone, as Mirrokni et al.
    status, home = sidecar.ask(1)
    assert status == 200 and home is not None
    # A stream held open on the home replica: it stays in flight until the test lets it end.
    with sidecar.client.stream("POST", f"{sidecar.base}/v1/chat/completions", json={
            **chat_body(1, 1), "stream": True,
            "recorder": {"mode": "lockstep", "chunks": 2}}) as held:
        chunks = held.iter_raw()
        assert b"c0" in next(chunks)
        assert sidecar.row(home)["in_flight"] == 1
        # 1 in flight over 4 replicas: the bound is ceil(1.25 * 2 / 4) = 1, the home is full.
        status, spilled = sidecar.ask(1, 2)
        assert status == 200 and spilled not in (None, home)
        assert sidecar.row(spilled)["choices"]["spill"] == 1
        replicas.recorders[home].events["ack-0"].set()
        rest = b"".join(chunks)
        assert b"[DONE]" in rest
    wait_until(lambda: sidecar.row(home)["in_flight"] == 0, "the stream to end")
    assert sidecar.ask(1, 3) == (200, home)        # back home once the load is gone


def test_an_ejected_replica_s_keys_move_and_return(sidecar_for: Any, replicas: Replicas) -> None:
    sidecar = sidecar_for()
    homes = {agent: sidecar.ask(agent)[1] for agent in range(8)}
    victim = homes[0]
    others = [a for a, home in homes.items() if home != victim]
    assert others
    replicas.switches[victim].down = True
    status, moved = sidecar.ask(0, 1)              # fails on the victim, retried on the next
    assert status == 200 and moved not in (None, victim)
    assert replicas.switches[victim].refused == 1
    assert sidecar.row(victim)["ejections"] == 1 and sidecar.row(victim)["retries"] == 1
    assert sidecar.row(moved)["choices"]["failover"] == 1
    assert sidecar.ask(0, 2) == (200, moved)       # ejected: not even tried now
    assert replicas.switches[victim].refused == 1
    for agent in others:                           # the other keys stay where they were
        assert sidecar.ask(agent, 1) == (200, homes[agent])
    replicas.switches[victim].down = False
    wait_until(lambda: sidecar.ask(0, 3) == (200, victim), "the key to return after backoff",
               interval=EJECT_S / 3)


def test_a_failed_connect_is_retried_once_on_the_next_replica(sidecar_for: Any,
                                                              replicas: Replicas) -> None:
    dead = [f"http://127.0.0.1:{free_port()}/v1" for _ in range(2)]
    sidecar = sidecar_for([dead[0], replicas.urls[0]], "round_robin")
    assert sidecar.ask(0) == (200, 0)              # dead first, then the live one
    assert sidecar.row(0)["retries"] == 1 and sidecar.row(0)["ejected"]
    assert sidecar.row(1)["choices"]["failover"] == 1
    # Two dead replicas first in line: one retry only, and the client gets the failure.
    sidecar = sidecar_for([*dead, replicas.urls[1]], "round_robin")
    status, replica = sidecar.ask(0)
    assert (status, replica) == (502, None)
    assert [r["requests"] for r in sidecar.pool.snapshot()] == [1, 1, 0]
    assert sidecar.ask(0) == (200, 1)              # both dead ones are ejected now


def test_a_stream_that_fails_after_its_first_byte_is_not_retried(sidecar_for: Any,
                                                                 replicas: Replicas) -> None:
    sidecar = sidecar_for(replicas.urls[:2], "round_robin")
    r = sidecar.client.post(f"{sidecar.base}/v1/chat/completions", json={
        **chat_body(0, 0), "stream": True, "recorder": {"mode": "break", "chunks": 3}})
    assert r.status_code == 200
    assert b"c0" in r.content and b"upstream_interrupted" in r.content
    assert replicas.received() == 1                # nobody else was asked
    assert sum(row["retries"] for row in sidecar.pool.snapshot()) == 0
    # The relay closes the upstream response after the client's last byte.
    wait_until(lambda: sidecar.row(0)["in_flight"] == 0, "the relay to close the stream")
    assert sidecar.row(0)["ejections"] == 1


def test_tenants_with_the_same_static_prefix_are_routed_independently(
        sidecar_for: Any) -> None:
    sidecar = sidecar_for(api_keys={"key-a": "alpha", "key-b": "beta"})
    differ = 0
    for agent in range(12):
        homes = {}
        for api_key, tenant in (("key-a", "alpha"), ("key-b", "beta")):
            boundary = sidecar.client.post(f"{sidecar.base}/v1/prefix/boundary",
                                           headers=bearer(api_key),
                                           json=chat_body(agent, 0)).json()
            expected = affinity_order(routing_key(tenant, boundary["key"]), sidecar.pool.names)[0]
            turns = [sidecar.ask(agent, turn, key=api_key) for turn in range(2)]
            assert turns == [(200, expected)] * 2
            homes[tenant] = expected
        differ += homes["alpha"] != homes["beta"]
    assert differ > 0                              # not one shared placement


def test_readyz_reports_each_replica_and_ejects_the_failing_one(sidecar_for: Any,
                                                                replicas: Replicas) -> None:
    sidecar = sidecar_for()
    home = sidecar.ask(5)[1]
    assert home is not None
    replicas.switches[home].down = True
    report = sidecar.client.get(f"{sidecar.base}/readyz").json()
    assert report["status"] == "ready"             # the pool still answers
    rows = report["upstreams"][MODEL]["replicas"]
    assert [rows[u]["ok"] for u in sidecar.pool.names] == [i != home for i in range(REPLICAS)]
    assert rows[sidecar.pool.names[home]]["ejected"] is True
    status, moved = sidecar.ask(5, 1)
    assert status == 200 and moved != home and replicas.switches[home].refused == 1  # probe only
    replicas.switches[home].down = False
    sidecar.client.get(f"{sidecar.base}/readyz")   # a passed probe routes to it again at once
    assert sidecar.ask(5, 2) == (200, home)


def test_metrics_and_dashboard_show_each_replica(sidecar_for: Any) -> None:
    sidecar = sidecar_for()
    for agent in range(4):
        sidecar.ask(agent)
    text = sidecar.client.get(f"{sidecar.base}/metrics").text
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("prefix_cache_upstream_requests_total{"))
    assert total == 4
    for name in sidecar.pool.names:
        assert f'prefix_cache_upstream_in_flight{{model="{MODEL}",replica="{name}"}} 0.0' in text
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    grafana = json.loads(GRAFANA_DASHBOARD.read_text())
    queried = {m for p in grafana["panels"] for t in p.get("targets", [])
               for m in re.findall(r"\b(prefix_cache_upstream_[a-z_]+)", t["expr"])}
    assert len(queried) >= 4 and not queried - exposed, sorted(queried - exposed)
    stats = sidecar.client.get(f"{sidecar.base}/dashboard/stats.json").json()
    rows = stats["upstream_replicas"]
    assert [r["replica"] for r in rows] == sidecar.pool.names
    assert sum(r["requests"] for r in rows) == 4 and {r["model"] for r in rows} == {MODEL}


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="Debian chromium/chromedriver not installed")
def test_the_dashboard_draws_the_replicas_panel(sidecar_for: Any, replicas: Replicas) -> None:
    pytest.importorskip("selenium.webdriver")
    sidecar = sidecar_for(eject_s=600.0)          # still out when the page draws
    home = sidecar.ask(2)[1]
    assert home is not None
    replicas.switches[home].down = True
    assert sidecar.ask(2, 1)[0] == 200             # fails over; the home is ejected
    with headless_chromium() as driver:
        driver.get(f"{sidecar.base}/dashboard?poll_ms=300")
        rows = wait_for_js(driver, "const r = document.querySelectorAll('#replicas tbody tr');"
                                   "return r.length === 4 && [...r].map(tr => "
                                   "[...tr.children].map(td => td.textContent));")
        assert [row[1] for row in rows] == sidecar.pool.names
        assert [row[2] for row in rows] == ["ejected" if i == home else "up"
                                            for i in range(REPLICAS)]
        assert sum(int(row[7]) for row in rows) == 1       # the one failover
        assert driver.find_element("id", "replicas-panel").is_displayed()
        assert not browser_errors(driver)


# -- configuration ------------------------------------------------------------------------------


def test_repeated_upstream_flags_make_a_pool(demo_folder: Path) -> None:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(["--upstream", "http://a:1", "--upstream", "http://b:2"])
    settings = ServiceSettings(model_dirs=[demo_folder], **flag_overrides(vars(args)))
    (spec,) = load_model_specs(settings)
    assert (spec.upstream, spec.upstreams, spec.routing) == (
        None, ["http://a:1", "http://b:2"], None)
    one = ServiceSettings(model_dirs=[demo_folder], upstream="http://a:1")
    (spec,) = load_model_specs(one)
    assert (spec.upstream, spec.upstreams) == ("http://a:1", None)    # a lone upstream, as before


def test_the_upstream_variable_takes_a_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_CACHE_UPSTREAM", "http://a:1, http://b:2")
    monkeypatch.setenv("PREFIX_CACHE_UPSTREAM_ROUTING", "round_robin")
    settings = ServiceSettings()
    assert (settings.upstream, settings.upstream_routing) == (
        ["http://a:1", "http://b:2"], "round_robin")
    monkeypatch.setenv("PREFIX_CACHE_UPSTREAM", "")
    assert ServiceSettings().upstream is None


def test_a_models_file_names_a_pool(tmp_path: Path, demo_folder: Path) -> None:
    from prefix_cache.service.served_models import load_model

    path = tmp_path / "models.yaml"
    path.write_text(json.dumps({"pool": {
        "folder": str(demo_folder), "upstreams": ["http://a:1", "http://b:2/v1"],
        "upstream_kind": "specprefill", "routing": "least_loaded",
        "routing_load_factor": 1.5, "routing_load_floor": 2}}))
    (spec,) = load_model_specs(ServiceSettings(models_file=path, upstream="http://c:3"))
    model = load_model(spec, loader=lambda *_: None)
    assert model.pool is not None and model.upstream is not None
    assert model.pool.names == ["http://a:1/v1", "http://b:2/v1"]
    assert (model.pool.policy, model.pool.load_factor, model.pool.load_floor) == (
        "least_loaded", 1.5, 2)
    assert {r.upstream.kind for r in model.pool.replicas} == {"specprefill"}


@pytest.mark.parametrize(("entry", "message"), [
    ({"upstream": "http://a:1", "upstreams": ["http://b:2"]}, "one of 'upstream'"),
    ({"upstreams": ["http://a:1", "http://a:1/v1"]}, "listed twice"),
    ({"upstreams": []}, "empty"),
    ({"upstreams": ["ftp://a"]}, "http"),
    ({"upstreams": ["http://a:1"], "routing": "nearest"}, "routing"),
    ({"upstreams": ["http://a:1"], "routing_load_factor": 0.5}, "routing_load_factor"),
    ({"upstreams": ["http://a:1"], "routing_load_floor": 0}, "routing_load_floor"),
    ({"upstreams": ["http://a:1"], "engine": "mlx"}, "both"),
])
def test_bad_pools_are_refused(tmp_path: Path, demo_folder: Path, entry: dict[str, Any],
                               message: str) -> None:
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"m": {"folder": str(demo_folder), **entry}}))
    with pytest.raises(ValueError, match=message):
        load_model_specs(ServiceSettings(models_file=path))

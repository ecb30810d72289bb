"""The dashboard's history (issue 40, part 2): 10 s intervals in a bounded ring per worker,
merged across workers through their files, served as ``GET /dashboard/history.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefix_cache.metrics.history import FIELDS, History
from prefix_cache.metrics.history_series import SERIES, history_document
from tests.support.clock import Clock
from tests.support.loopback import local_client
from tests.support.sidecar import bearer, served, sidecar_app, unique_system, write_keys_file

ACME, ADMIN = "sk-hist-acme", "sk-hist-admin"
T0 = 1_800_000_000.0  # a whole multiple of 10 s


class WallClock(Clock):
    """A wall clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        super().__init__()
        self.now = now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def points(doc: dict[str, Any], name: str) -> list[Any]:
    return [v for _, v in doc["series"][name]]


def test_intervals_hold_rates_ratios_and_ttft_percentiles() -> None:
    clock = WallClock(T0)
    history = History(clock=clock, folder=None)
    for _ in range(3):
        history.lookup("acme", "demo", "hit")
    history.lookup("acme", "demo", "miss")
    history.request("acme", "demo", "hit", 200, 0.004, prompt=100, cached=80, generated=5)
    history.request("acme", "demo", "miss", 200, 0.3, prompt=100, cached=0, generated=5)
    history.request("acme", "demo", "miss", 429, None, prompt=0, cached=0, generated=0)
    clock.advance(10)  # the first interval is whole; the second has no traffic
    history.lookup("globex", "demo", "miss")
    clock.advance(5)
    doc = history_document(history, 3600)
    assert doc["interval_s"] == 10 and set(SERIES) <= set(doc["series"])
    assert [t for t, _ in doc["series"]["hit_rate"]] == [T0, T0 + 10]
    assert points(doc, "hit_rate") == [0.75, 0.0]
    assert points(doc, "requests_per_s") == [0.4, 1 / 5]  # the current interval: over 5 s
    assert points(doc, "api_requests_per_s")[0] == 0.3
    assert points(doc, "errors_per_s")[0] == 0.1
    assert points(doc, "prompt_tokens_reused_per_s")[0] == 8.0
    assert points(doc, "prompt_tokens_computed_per_s")[0] == 12.0
    hit_p50, miss_p50 = points(doc, "ttft_p50_hit_s")[0], points(doc, "ttft_p50_miss_s")[0]
    assert 0.0025 < hit_p50 <= 0.005 and 0.25 < miss_p50 <= 0.5
    assert points(doc, "ttft_p50_hit_s")[1] is None  # nothing measured: a gap, not a zero
    assert doc["tenants"] == ["acme", "globex"]
    assert points(doc, "tenant:acme:hit_rate") == [0.75, None]
    assert points(doc, "tenant:globex:hit_rate") == [None, 0.0]
    assert points(doc, "model:demo:requests_per_s") == points(doc, "requests_per_s")


def test_the_ring_is_bounded_and_seconds_cut_it() -> None:
    clock = WallClock(T0)
    history = History(clock=clock, folder=None, keep=6)
    for _ in range(20):
        history.lookup("acme", "demo", "hit")
        clock.advance(10)
    assert len(history.merged()[0]) <= 6  # the ring itself, not only what a document shows
    assert len(history_document(history, 10_000)["series"]["hit_rate"]) == 6
    assert len(history_document(history, 30)["series"]["hit_rate"]) == 3


def test_workers_merge_through_their_files(tmp_path: Path) -> None:
    clock = WallClock(T0)
    one = History(clock=clock, folder=str(tmp_path), worker=1)
    two = History(clock=clock, folder=str(tmp_path), worker=2)
    one.lookup("acme", "demo", "hit")
    one.request("acme", "demo", "hit", 200, 0.01, prompt=10, cached=8, generated=1)
    two.lookup("acme", "demo", "miss")
    two.request("acme", "demo", "miss", 200, 0.2, prompt=10, cached=0, generated=1)
    two.sample_engines({"tiny": [100.0, 50.0, 3.0, 0.0]})
    two.write(force=True)
    clock.advance(10)
    doc = history_document(one, 60)  # either worker answers with both
    assert points(doc, "hit_rate")[0] == 0.5
    assert points(doc, "prompt_tokens_reused_per_s")[0] == 0.8
    assert points(doc, "ttft_p50_hit_s")[0] is not None and points(doc, "ttft_p50_miss_s")[0]
    assert doc["engines"] == ["tiny"] and points(doc, "engine:tiny:ram_bytes")[0] == 100.0
    assert history_document(two, 60)["series"]["hit_rate"] == doc["series"]["hit_rate"]
    # A broken file (a worker killed mid-write cannot leave one: writes are renamed into
    # place) is skipped, never an error.
    (tmp_path / "history_3.json").write_text("{not json")
    assert points(history_document(one, 60), "hit_rate")[0] == 0.5


def test_tallies_have_the_documented_fields() -> None:
    assert FIELDS[:3] == ("lookups", "hits", "misses")


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Any) -> Any:
    keys = write_keys_file(tmp_path_factory.mktemp("hist") / "keys.yaml", {ACME: "acme"},
                           admin_keys=[ADMIN])
    return sidecar_app(served("demo", demo_tokenizer), keys_file=keys)


def test_history_json_needs_the_admin_key_and_a_positive_seconds(base: str) -> None:
    with local_client(base_url=base) as http:
        system = unique_system()
        for _ in range(3):
            assert http.post("/v1/prefix/boundary", headers=bearer(ACME), json={
                "messages": [system, {"role": "user", "content": "hi"}]}).status_code == 200
        assert http.get("/dashboard/history.json").status_code == 401
        assert http.get("/dashboard/history.json", headers=bearer(ACME)).status_code == 401
        for bad in ("-5", "0", "nan", "inf", "soon"):
            r = http.get(f"/dashboard/history.json?seconds={bad}", headers=bearer(ADMIN))
            assert r.status_code in (400, 422) and "seconds" in r.text, (bad, r.text)
        r = http.get("/dashboard/history.json?seconds=600", headers=bearer(ADMIN))
    assert r.status_code == 200
    doc = r.json()
    assert doc["interval_s"] == 10 and doc["tenants"] == ["acme"]
    rates = [v for _, v in doc["series"]["tenant:acme:hit_rate"] if v is not None]
    assert rates and rates[-1] > 0
    assert sum(v for _, v in doc["series"]["requests_per_s"]) > 0

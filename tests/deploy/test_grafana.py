"""The Grafana dashboard queries only metrics the service really exposes."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from prefix_cache import StaticPrefixCache
from prefix_cache.http.request_record import RequestRecord
from prefix_cache.metrics import Metrics
from prefix_cache.metrics.engine import EngineCollector
from prefix_cache.service.pool import UpstreamPool
from prefix_cache.service.pool_metrics import PoolMetrics
from prefix_cache.service.upstream import Upstream
from tests.support.engine_stats import ENGINE_STATS, StatsEngine
from tests.support.grafana import queried_metrics
from tests.support.paths import GRAFANA_DASHBOARD, REPO
from tests.support.templates import BEHAVIOURS


def exposed_metrics(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def every_metric(qwen3: Any) -> str:
    """The exposition of a sidecar's metrics with every family holding samples."""
    metrics = Metrics()
    cache = StaticPrefixCache(observer=metrics)
    for i in range(3):
        cache.resolve(qwen3, [{"role": "system", "content": "s"}, {"role": "user", "content": str(i)}],
                      chat_template=BEHAVIOURS["default_system"])
    metrics.store_error(op="get")
    metrics.verification_failure()
    metrics.refresh_store(cache.store.stats())
    # One API request answered: the request-level families get their samples.
    started = time.perf_counter() - 0.05
    record = RequestRecord("chat", started, tenant="acme", model="m", cache="hit", status=200,
                           prefilled=started + 0.008,
                           first_content=started + 0.01, last_content=started + 0.03,
                           content_gaps=[0.02], finish_reason="stop", prompt_tokens=10,
                           cached_tokens=8, generation_tokens=2)
    metrics.request_started(record)   # waiting
    record.dispatch()                 # running
    metrics.request_done(record)      # neither
    # The in-process engine's counters (stats shaped as MLXEngine.snapshot_stats(); the live
    # sidecar with a real engine is checked against the same queries in test_engine_serving).
    with_conversation = replace(ENGINE_STATS, conversation_store=ENGINE_STATS.kv_store)
    metrics.add_collector(EngineCollector(lambda: [("m", StatsEngine(with_conversation))]))
    # A pool's per-replica routing metrics (tests/service/test_upstream_pool.py checks a live pool).
    PoolMetrics(metrics).watch("m", UpstreamPool([Upstream("http://a:1"), Upstream("http://b:2")]))
    return metrics.exposition()[0].decode()


def test_every_dashboard_metric_is_exposed(qwen3: Any) -> None:
    exposed = exposed_metrics(every_metric(qwen3))
    missing = queried_metrics() - exposed
    assert not missing, f"dashboard queries metrics /metrics does not have: {sorted(missing)}"
    assert len(queried_metrics()) >= 10


def test_docs_say_what_every_metric_means(qwen3: Any) -> None:
    """docs/metrics.md has a row for every family /metrics exposes (and no stale one)."""
    families = {f.name + ("_total" if f.type == "counter" else "")
                for f in text_string_to_metric_families(every_metric(qwen3))}
    documented = set(re.findall(r"^\| `(prefix_cache_[a-z0-9_]+)` \|",
                                (REPO / "docs" / "metrics.md").read_text(), re.MULTILINE))
    assert families == documented


def test_no_created_series_and_vllms_names_and_buckets(qwen3: Any) -> None:
    """No ``*_created`` series; the names ARCHITECTURE.md fixes after vLLM's; TTFT buckets to
    vLLM's 2,560 s; store evictions a counter."""
    families = {f.name: f for f in text_string_to_metric_families(every_metric(qwen3))}
    samples = {s.name for f in families.values() for s in f.samples}
    assert not [name for name in samples if name.endswith("_created")]
    for name, kind in (("num_requests_waiting", "gauge"), ("num_requests_running", "gauge"),
                       ("request_queue_time_seconds", "histogram"),
                       ("inter_token_latency_seconds", "histogram"),
                       ("request_prefill_time_seconds", "histogram"),
                       ("request_decode_time_seconds", "histogram"),
                       ("request_success", "counter"), ("kv_cache_usage_perc", "gauge"),
                       ("store_evictions", "counter")):
        assert families[f"prefix_cache_{name}"].type == kind, name
    ttft = families["prefix_cache_time_to_first_token_seconds"]
    bounds = {float(s.labels["le"]) for s in ttft.samples if s.name.endswith("_bucket")}
    assert max(bounds - {float("inf")}) == 2560.0
    success = [s for s in families["prefix_cache_request_success"].samples
               if s.name.endswith("_total")]
    assert [(s.labels["finished_reason"], s.value) for s in success] == [("stop", 1.0)]
    # The request ended: the gauges are back at zero.
    assert [s.value for s in families["prefix_cache_num_requests_running"].samples] == [0.0]
    assert [s.value for s in families["prefix_cache_num_requests_waiting"].samples] == [0.0]


def dashboard() -> dict:
    return json.loads(GRAFANA_DASHBOARD.read_text())


def test_every_panel_has_one_unit() -> None:
    for panel in dashboard()["panels"]:
        config = panel["fieldConfig"]
        assert config["defaults"].get("unit"), panel["title"]
        others = [p for o in config.get("overrides", []) for p in o.get("properties", [])
                  if p.get("id") == "unit"]
        assert others == [], panel["title"]


def test_tenant_and_model_variables_filter_the_request_panels() -> None:
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) >= {"tenant", "model"}
    for name, var in variables.items():
        assert var["definition"] == f"label_values(prefix_cache_http_requests_total, {name})"
        assert var["includeAll"] and var["allValue"] == ".*"
    request_metrics = re.compile(r"prefix_cache_(http_requests_total|e2e_request_latency_seconds|"
                                 r"time_to_first_token_seconds|prompt_tokens_total|"
                                 r"prompt_tokens_cached_total|generation_tokens_total)")
    filtered = 0
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            for match in re.finditer(r"(prefix_cache_[a-z0-9_]+)(\{[^}]*\})?", target["expr"]):
                if request_metrics.fullmatch(match.group(1).removesuffix("_bucket")):
                    assert 'tenant=~"$tenant"' in (match.group(2) or ""), target["expr"]
                    assert 'model=~"$model"' in (match.group(2) or ""), target["expr"]
                    filtered += 1
    assert filtered >= 10
    titles = " ".join(p["title"] for p in dash["panels"])
    for needed in ("Time to first token: hit vs miss", "latency by status", "tokens"):
        assert needed.lower() in titles.lower(), needed

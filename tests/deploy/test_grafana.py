"""The Grafana dashboard queries only metrics the service really exposes."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from prefix_cache import StaticPrefixCache
from prefix_cache.metrics.engine import EngineCollector
from prefix_cache.metrics import Metrics
from prefix_cache.service.pool import UpstreamPool
from prefix_cache.service.pool_metrics import PoolMetrics
from prefix_cache.service.upstream import Upstream

from tests.support.engine_stats import ENGINE_STATS, StatsEngine
from tests.support.grafana import queried_metrics
from tests.support.templates import BEHAVIOURS

def exposed_metrics(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_every_dashboard_metric_is_exposed(qwen3) -> None:
    metrics = Metrics()
    cache = StaticPrefixCache(observer=metrics)
    for i in range(3):
        cache.resolve(qwen3, [{"role": "system", "content": "s"}, {"role": "user", "content": str(i)}],
                      chat_template=BEHAVIOURS["default_system"])
    metrics.store_error(op="get")
    metrics.verification_failure()
    metrics.refresh_store(cache.store.stats())
    # The in-process engine's counters (stats shaped as MLXEngine.snapshot_stats(); the live
    # sidecar with a real engine is checked against the same queries in test_engine_serving).
    with_conversation = replace(ENGINE_STATS, conversation_store=ENGINE_STATS.kv_store)
    metrics.add_collector(EngineCollector(lambda: [("m", StatsEngine(with_conversation))]))
    # A pool's per-replica routing metrics (tests/service/test_upstream_pool.py checks a live pool).
    PoolMetrics(metrics).watch("m", UpstreamPool([Upstream("http://a:1"), Upstream("http://b:2")]))
    exposed = exposed_metrics(metrics.exposition()[0].decode())
    missing = queried_metrics() - exposed
    assert not missing, f"dashboard queries metrics /metrics does not have: {sorted(missing)}"
    assert len(queried_metrics()) >= 10

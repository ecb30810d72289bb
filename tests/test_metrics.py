"""Metrics: recorded at event time, exposed for Prometheus, and the JSON stats from the same samples."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from prometheus_client.parser import text_string_to_metric_families

from prefix_cache import StaticPrefixCache
from prefix_cache.metrics import Metrics, TenantLabels, _quantile

from .templates import BEHAVIOURS

TEMPLATE = BEHAVIOURS["default_system"]


def conv(i: int) -> list[dict]:
    return [{"role": "system", "content": f"agent {i % 2}"}, {"role": "user", "content": f"q{i}"}]


def parsed(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = metrics.exposition()[0].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_counts_agree_between_exposition_and_snapshot(qwen3) -> None:
    metrics = Metrics()
    cache = StaticPrefixCache(observer=metrics)
    for i in range(10):
        cache.resolve(qwen3, conv(i), chat_template=TEMPLATE, namespace="acme", model="demo")
    cache.resolve(qwen3, [{"role": "user", "content": "x"}], chat_template=TEMPLATE, namespace="acme", model="demo")
    metrics.refresh_store(cache.store.stats())
    samples = parsed(metrics)
    key = lambda result: ("prefix_cache_requests_total", (("model", "demo"), ("result", result), ("tenant", "acme")))  # noqa: E731
    assert samples[key("hit")] == 8 and samples[key("miss")] == 2 and samples[key("none")] == 1
    assert samples[("prefix_cache_renders_total", (("model", "demo"),))] == 4
    snap = metrics.snapshot()
    assert (snap["hits"], snap["misses"], snap["renders"]) == (8, 2, 4)
    assert snap["hit_rate"] == 0.8 == cache.stats.snapshot()["hit_rate"]
    assert snap["store"]["entries"] == 2 and snap["store"]["bytes"] > 0
    assert snap["render_seconds_saved"] > 0
    assert snap["tenants"][0]["name"] == "acme" and snap["tenants"][0]["hit"] == 8
    assert snap["latency_seconds"]["hit"]["p50"] is not None
    for name in ("prefix_cache_lookup_seconds_bucket", "prefix_cache_render_seconds_bucket",
                 "prefix_cache_static_prefix_tokens_bucket", "prefix_cache_render_seconds_saved_total"):
        assert any(n == name for n, _ in samples), name


def test_tenant_labels_are_bounded() -> None:
    labels = TenantLabels(max_tenants=2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


def test_quantile_interpolates_like_histogram_quantile() -> None:
    buckets = [(0.1, 50.0), (0.2, 100.0), (float("inf"), 100.0)]
    assert _quantile(buckets, 0.5) == 0.1
    assert abs(_quantile(buckets, 0.75) - 0.15) < 1e-9
    assert _quantile([], 0.5) is None


def test_several_workers_aggregate(tmp_path) -> None:
    """Two worker processes record; a third (the scraping one) sees the sum."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    worker = textwrap.dedent("""
        import sys
        from prefix_cache.metrics import Metrics
        m = Metrics()
        for _ in range(int(sys.argv[1])):
            m.resolved(cache="hit", namespace="t", model="m", seconds=0.001, static_tokens=10, boundary=10)
        m.resolved(cache="miss", namespace="t", model="m", seconds=0.05, static_tokens=10, boundary=10)
        m.refresh_store({"backend": "memory", "entries": 3, "bytes": 100, "evictions": 0})
        """)
    for n in (5, 7):
        subprocess.run([sys.executable, "-c", worker, str(n)], env=env, check=True, timeout=60)
    scrape = "from prefix_cache.metrics import Metrics; import json; print(json.dumps(Metrics().snapshot()))"
    out = subprocess.run([sys.executable, "-c", scrape], env=env, check=True, timeout=60,
                         capture_output=True, text=True).stdout
    import json

    snap = json.loads(out)
    assert (snap["hits"], snap["misses"]) == (12, 2)
    assert snap["store"]["entries"] == 6  # livesum over the workers (until marked dead)

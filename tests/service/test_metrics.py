"""Metrics: recorded at event time, exposed for Prometheus, and the JSON stats from the same samples."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_cache import StaticPrefixCache, TemplateRenderError
from prefix_cache.metrics.sidecar import Metrics, TenantLabels, _quantile

from tests.support.engine_stats import ENGINE_STATS, StatsEngine
from tests.support.templates import BEHAVIOURS, NO_SYSTEM_ROLE

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
    # Four probe renders per miss: the two probes and the two multi-turn probes.
    assert samples[("prefix_cache_renders_total", (("model", "demo"),))] == 8
    snap = metrics.snapshot()
    assert (snap["hits"], snap["misses"], snap["renders"]) == (8, 2, 8)
    assert snap["hit_rate"] == 0.8 == cache.stats.snapshot()["hit_rate"]
    assert snap["store"]["entries"] == 2 and snap["store"]["bytes"] > 0
    assert snap["render_seconds_saved"] > 0
    assert snap["tenants"][0]["name"] == "acme" and snap["tenants"][0]["hit"] == 8
    assert snap["latency_seconds"]["hit"]["p50"] is not None
    for name in ("prefix_cache_lookup_seconds_bucket", "prefix_cache_render_seconds_bucket",
                 "prefix_cache_static_prefix_tokens_bucket", "prefix_cache_render_seconds_saved_total"):
        assert any(n == name for n, _ in samples), name


def test_the_cache_stats_and_the_metrics_are_one_tally(qwen3) -> None:
    """Both count the cache's events: a miss whose render fails is an error in both, never a
    miss in one and an error in the other."""
    metrics = Metrics()
    cache = StaticPrefixCache(observer=metrics)
    for i in range(4):
        cache.resolve(qwen3, conv(i), chat_template=TEMPLATE, namespace="acme", model="demo")
    with pytest.raises(TemplateRenderError):
        cache.resolve(qwen3, conv(9), chat_template=NO_SYSTEM_ROLE, namespace="acme", model="demo")
    cache.resolve(qwen3, [{"role": "user", "content": "x"}], chat_template=TEMPLATE,
                  namespace="acme", model="demo")
    ours, theirs = cache.stats.snapshot(), metrics.snapshot()
    assert (ours["hits"], ours["misses"], ours["none"], ours["errors"], ours["renders"]) == (
        theirs["hits"], theirs["misses"], theirs["requests"]["none"],
        theirs["requests"]["error"], theirs["renders"]) == (2, 2, 1, 1, 8)  # four probe renders per miss


def test_tenant_labels_are_bounded() -> None:
    labels = TenantLabels(max_tenants=2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


def test_quantile_interpolates_like_histogram_quantile() -> None:
    buckets = [(0.1, 50.0), (0.2, 100.0), (float("inf"), 100.0)]
    assert _quantile(buckets, 0.5) == 0.1
    assert abs(_quantile(buckets, 0.75) - 0.15) < 1e-9
    assert _quantile([], 0.5) is None


def test_several_workers_aggregate(tmp_path) -> None:
    """Two worker processes record; a third (the scraping one) sees the sum: counters of every
    worker that ever ran, live gauges of the workers alive now."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    worker = textwrap.dedent("""
        import sys
        from prefix_cache.metrics import Metrics
        from prefix_cache.store.base import MemoryStats, StoreStats
        m = Metrics()
        for _ in range(int(sys.argv[1])):
            m.resolved(cache="hit", namespace="t", model="m", seconds=0.001, static_tokens=10, boundary=10)
        m.resolved(cache="miss", namespace="t", model="m", seconds=0.05, static_tokens=10, boundary=10)
        m.refresh_store(StoreStats("memory", memory=MemoryStats(entries=3, bytes=100, max_bytes=1000,
                                                                evictions=0, expirations=0)))
        print("recorded", flush=True)
        sys.stdin.read()  # alive until the test closes stdin
        """)
    workers = [subprocess.Popen([sys.executable, "-c", worker, str(n)], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE) for n in (5, 7)]
    import json

    def scrape() -> dict:
        code = "from prefix_cache.metrics import Metrics; import json; print(json.dumps(Metrics().snapshot()))"
        return json.loads(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                         timeout=60, capture_output=True, text=True).stdout)
    try:
        assert [w.stdout.readline().strip() for w in workers] == ["recorded", "recorded"]
        snap = scrape()
        assert (snap["hits"], snap["misses"]) == (12, 2)
        assert snap["store"]["entries"] == 6  # livesum over the live workers
    finally:
        for w in workers:
            w.communicate(timeout=60)
    snap = scrape()
    assert (snap["hits"], snap["misses"]) == (12, 2)  # what the dead counted happened
    assert snap["store"]["entries"] == 0              # what they held is gone with them


def _engine_samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.exposition()[0].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("prefix_cache_engine_")}


def _check_engine_samples(samples: dict) -> None:
    m = (("model", "tiny"),)
    assert samples[("prefix_cache_engine_requests_total", m)] == 5
    assert samples[("prefix_cache_engine_specprefill_fallbacks_total", m)] == 1
    assert samples[("prefix_cache_engine_prompt_tokens_total", (("kind", "reused"), *m))] == 900
    assert samples[("prefix_cache_engine_prompt_tokens_total", (("kind", "computed"), *m))] == 120
    assert samples[("prefix_cache_engine_active_requests", m)] == 1
    static = (("model", "tiny"), ("store", "static"))
    assert samples[("prefix_cache_engine_kv_bytes", static)] == 4096
    hits = (("model", "tiny"), ("result", "hit"), ("store", "static"))
    assert samples[("prefix_cache_engine_kv_lookups_total", hits)] == 4
    assert samples[("prefix_cache_engine_kv_rejected_total", static)] == 2
    assert samples[("prefix_cache_engine_kv_disk_lookups_total", (*m, ("result", "hit")))] == 3
    assert samples[("prefix_cache_engine_kv_disk_bytes", m)] == 12288
    assert samples[("prefix_cache_engine_kv_disk_writes_total", (*m, ("result", "dropped")))] == 1
    assert samples[("prefix_cache_engine_kv_disk_load_seconds_sum", m)] == 0.25
    assert samples[("prefix_cache_engine_kv_disk_load_seconds_count", m)] == 3
    # the conversation store is off in these stats, and the broken engine is left out
    assert not any(dict(labels).get("store") == "conversation" for _, labels in samples)
    assert not any(dict(labels).get("model") == "broken" for _, labels in samples)


def test_engine_counters_are_exported_at_scrape_time() -> None:
    from prefix_cache.metrics.engine import EngineCollector

    metrics = Metrics()
    assert not _engine_samples(metrics)
    engines = [("tiny", StatsEngine(ENGINE_STATS)), ("broken", StatsEngine(None))]
    metrics.add_collector(EngineCollector(lambda: engines))
    _check_engine_samples(_engine_samples(metrics))
    engines[0][1].stats = replace(ENGINE_STATS, requests=6)  # read at scrape time, not copied
    assert _engine_samples(metrics)[("prefix_cache_engine_requests_total",
                                     (("model", "tiny"),))] == 6
    assert metrics.snapshot()["hits"] == 0               # the JSON stats are unaffected


def test_engine_counters_in_multiprocess_mode(tmp_path) -> None:
    code = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, ".")
        from prefix_cache.metrics.engine import EngineCollector
        from prefix_cache.metrics import Metrics
        from tests.service.test_metrics import _check_engine_samples, _engine_samples
        from tests.support.engine_stats import ENGINE_STATS, StatsEngine
        m = Metrics()
        m.add_collector(EngineCollector(lambda: [("tiny", StatsEngine(ENGINE_STATS)),
                                                 ("broken", StatsEngine(None))]))
        _check_engine_samples(_engine_samples(m))
        print("ok")
        """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, check=True,
                         timeout=60, capture_output=True, text=True).stdout
    assert out.strip() == "ok"

"""The merged history as ``GET /dashboard/history.json`` serves it:

    {"interval_s": 10, "series": {NAME: [[unix_time, value], ...]}, "tenants": [...],
     "models": [...], "engines": [...]}

One point per interval (its start time), the current interval's rates over the part of it
that has passed. ``NAME`` is a series of the whole service (``hit_rate``, ``requests_per_s``,
...), or of one tenant (``tenant:NAME:hit_rate``), one model (``model:NAME:...``), or one
in-process engine's KV tiers (``engine:MODEL:ram_bytes`` ...). A ratio or a percentile with
nothing to measure in an interval is null (a gap), a rate is 0.
"""

from __future__ import annotations

import math
from typing import Any

from .history import (
    ENGINE_FIELDS,
    N_BUCKETS,
    TALLY_LEN,
    TTFT_HIT,
    TTFT_MISS,
    History,
)
from .requests import TTFT_BUCKETS
from .sidecar import _quantile

SERIES = ("hit_rate", "requests_per_s", "api_requests_per_s", "errors_per_s", "ttft_p50_hit_s",
          "ttft_p50_miss_s", "prompt_tokens_reused_per_s", "prompt_tokens_computed_per_s",
          "generation_tokens_per_s")
_BOUNDS = (*TTFT_BUCKETS, math.inf)


def _p50(counts: list[float]) -> float | None:
    cumulative, total = [], 0.0
    for bound, count in zip(_BOUNDS, counts, strict=True):
        total += count
        cumulative.append((bound, total))
    return _quantile(cumulative, 0.5)


def tally_values(t: list[float], span_s: float) -> dict[str, float | None]:
    """An interval's (summed) tally as the value of each series."""
    lookups, hits, misses, requests, errors, prompt, cached, generated = t[:8]
    looked = hits + misses
    return {
        "hit_rate": hits / looked if looked else None,
        "requests_per_s": lookups / span_s,
        "api_requests_per_s": requests / span_s,
        "errors_per_s": errors / span_s,
        "ttft_p50_hit_s": _p50(t[TTFT_HIT:TTFT_HIT + N_BUCKETS]),
        "ttft_p50_miss_s": _p50(t[TTFT_MISS:TTFT_MISS + N_BUCKETS]),
        "prompt_tokens_reused_per_s": cached / span_s,
        "prompt_tokens_computed_per_s": max(0.0, prompt - cached) / span_s,
        "generation_tokens_per_s": generated / span_s,
    }


def history_document(history: History, seconds: float) -> dict[str, Any]:
    """The last ``seconds`` of the service's history (at most what the ring keeps)."""
    intervals, engines, started = history.merged()
    step = history.interval_s
    now = history.clock()
    current = int(now // step)
    first = max(current - math.ceil(seconds / step) + 1, int(started // step),
                current - history.keep + 1)
    tenants = sorted({t for i in intervals.values() for (t, _) in i if t})
    models = sorted({m for i in intervals.values() for (_, m) in i if m})
    groups = [("", None, None), *((f"tenant:{t}:", t, None) for t in tenants),
              *((f"model:{m}:", None, m) for m in models)]
    series: dict[str, list[list[float | None]]] = {
        prefix + name: [] for prefix, _, _ in groups for name in SERIES}
    for i in range(first, current + 1):
        span = step if i < current else max(1.0, now - i * step)
        tallies = intervals.get(i, {})
        for prefix, tenant, model in groups:
            summed = [0.0] * TALLY_LEN
            for (t, m), tally in tallies.items():
                if (tenant is None or t == tenant) and (model is None or m == model):
                    summed = [a + b for a, b in zip(summed, tally, strict=True)]
            for name, value in tally_values(summed, span).items():
                series[prefix + name].append([i * step, value])
    engine_models = sorted({m for s in engines.values() for m in s})
    series.update(_engine_series(engines, engine_models, first, current, step))
    return {"interval_s": step, "series": series, "tenants": tenants, "models": models,
            "engines": engine_models}


def _engine_series(engines: dict[int, dict[str, list[float]]], models: list[str], first: int,
                   current: int, step: int) -> dict[str, list[list[float | None]]]:
    """Per engine: RAM and disk KV bytes (as sampled), KV hits and evictions per second (the
    counters' change since the interval before)."""
    out: dict[str, list[list[float | None]]] = {}
    ram, disk, hits, evictions = (ENGINE_FIELDS.index(f) for f in (
        "ram_bytes", "disk_bytes", "kv_hits", "kv_evictions"))
    for model in models:
        rows: dict[str, list[list[float | None]]] = {
            f"engine:{model}:{n}": [] for n in ("ram_bytes", "disk_bytes", "kv_hits_per_s",
                                                 "kv_evictions_per_s")}
        before = engines.get(first - 1, {}).get(model)
        for i in range(first, current + 1):
            sample = engines.get(i, {}).get(model)
            t = i * step
            rows[f"engine:{model}:ram_bytes"].append([t, sample[ram] if sample else None])
            rows[f"engine:{model}:disk_bytes"].append([t, sample[disk] if sample else None])
            for name, index in (("kv_hits_per_s", hits), ("kv_evictions_per_s", evictions)):
                rate = (max(0.0, sample[index] - before[index]) / step
                        if sample and before else None)
                rows[f"engine:{model}:{name}"].append([t, rate])
            before = sample or before
        out.update(rows)
    return out

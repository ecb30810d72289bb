"""The metrics the Grafana dashboard in ``deploy/`` queries."""

from __future__ import annotations

import json
import re

from .paths import GRAFANA_DASHBOARD

METRIC = re.compile(r"\b(prefix_cache_[a-z0-9_]+)")


def queried_metrics() -> set[str]:
    dash = json.loads(GRAFANA_DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    return {m for e in exprs for m in METRIC.findall(e)}

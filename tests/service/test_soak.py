"""The soak script, short (what CI can afford): many agents of several tenants through
``serve --workers 2`` with Redis, every request also sent to the upstream alone. No errors, no
boundary that changes between answers for one agent and turn, hits in the soak's 70-95% band,
memory that does not run away. The full 10-minute run and its figures: docs/reliability.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO
from tests.support.redis_server import needs_redis

pytestmark = needs_redis
DURATION_S = 20


def test_short_soak() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/soak.py", "--duration", str(DURATION_S), "--agents", "40",
         "--clients", "6", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=2 * DURATION_S + 240,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads(lines[-1])
    assert summary["errors"] == 0, summary["error_kinds"]
    assert summary["boundary_mismatches"] == 0
    assert summary["store"] == "redis" and summary["requests"] > 50
    assert 0.70 <= summary["hit_rate"] <= 0.95, summary
    assert 0 < summary["rss_start_mb"] and summary["rss_end_mb"] < 2 * summary["rss_start_mb"]
    trace = summary["rss_by_tenth_mb"]
    assert len(trace) == 11 and trace[0] == summary["rss_start_mb"]
    assert max(trace) <= summary["rss_max_mb"]
    assert summary["sidecar_p50_ms"] is not None and summary["direct_p50_ms"] is not None
    assert proc.returncode == 0

"""Counters of one cache: what it served, what it rendered, what it saved."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class CacheStats:
    """Monotonic counters; ``add`` is thread-safe, reads are snapshots via ``snapshot``."""

    hits: int = 0
    misses: int = 0
    none: int = 0                       # requests with no static part to protect
    coalesced: int = 0                  # misses that waited on another request's render
    errors: int = 0                     # requests that failed (bad input, template errors)
    renders: int = 0                    # probe renders (four per computed static prefix)
    prompt_renders: int = 0             # renders of the real prompt (no prompt_ids given)
    cap_renders: int = 0                # renders locating a request's first non-static text
    render_seconds: float = 0.0         # time spent in probe renders
    render_seconds_saved: float = 0.0   # probe-render time that hits did not spend
    verification_failures: int = 0      # stored entries rejected (corrupt, foreign, collision)
    store_errors: int = 0               # store calls that failed and were treated as misses
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            data: dict[str, Any] = {
                f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")
            }
        lookups = data["hits"] + data["misses"]
        data["hit_rate"] = data["hits"] / lookups if lookups else 0.0
        return data

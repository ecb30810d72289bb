"""Counters of one cache, tallied from its events: what it served, rendered and saved.

``CacheStats`` is an observer like the service's metrics, fed the very same events, so the two
tallies cannot disagree about what happened in a process (the metrics also sum the workers).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

from .observer import CacheObserver


@dataclass
class CacheStats(CacheObserver):
    """Monotonic counters; thread-safe; reads are snapshots via ``snapshot``."""

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
    fast_tokenizations: int = 0         # rendered prompts tokenized from their entry's split
    full_tokenizations: int = 0         # rendered prompts tokenized whole
    tokenize_checks: int = 0            # sampled fast tokenizations re-done in full
    tokenize_mismatches: int = 0        # ... that differed (the fast path is then off)
    # Model -> why fast tokenization is off for it (its tokenizer, a static text without a
    # safe split, a failed check): the latest reason seen.
    fast_tokenize_off: dict[str, str] = field(default_factory=dict)
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
            data["fast_tokenize_off"] = dict(self.fast_tokenize_off)
        lookups = data["hits"] + data["misses"]
        data["hit_rate"] = data["hits"] / lookups if lookups else 0.0
        return data

    # -- the events ------------------------------------------------------------------------

    def resolved(self, *, cache: str, namespace: str, model: str, seconds: float,
                 static_tokens: int, boundary: int) -> None:
        self.add(**{{"hit": "hits", "miss": "misses"}.get(cache, "none"): 1})

    def failed(self, *, namespace: str, model: str, error: Exception) -> None:
        self.add(errors=1)

    def computed(self, *, model: str, seconds: float, static_tokens: int, renders: int = 2) -> None:
        self.add(renders=renders, render_seconds=seconds)

    def saved(self, *, model: str, seconds: float) -> None:
        self.add(render_seconds_saved=seconds)

    def waited(self) -> None:
        self.add(coalesced=1)

    def prompt_rendered(self) -> None:
        self.add(prompt_renders=1)

    def cap_rendered(self) -> None:
        self.add(cap_renders=1)

    def store_error(self, *, op: str) -> None:
        self.add(store_errors=1)

    def verification_failure(self) -> None:
        self.add(verification_failures=1)

    def tokenized(self, *, model: str, fast: bool, reason: str) -> None:
        self.add(**{"fast_tokenizations" if fast else "full_tokenizations": 1})

    def tokenize_checked(self, *, model: str, mismatch: bool) -> None:
        self.add(tokenize_checks=1, tokenize_mismatches=int(mismatch))

    def fast_path_off(self, *, model: str, reason: str) -> None:
        with self._lock:
            self.fast_tokenize_off[model] = reason

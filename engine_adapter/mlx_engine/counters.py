"""The engine's counters since it started: written by the engine thread only, read as one
``EngineStats`` record by ``MLXEngine.snapshot_stats()``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineCounters:
    """Counters since the engine started (``snapshot_stats()`` reads them)."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    specprefill: int = 0
    fallbacks: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    parked: int = 0            # waited for a request computing the same static prefix
    conversation_hits: int = 0  # restored more than the static prefix from an earlier prompt
    last_fallback: str | None = None

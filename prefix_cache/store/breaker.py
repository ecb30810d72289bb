"""A circuit breaker for a network store: a dead or hung server costs one timeout per probe window.

closed ──failure──> open ──window elapsed──> half-open (one probe) ──success──> closed
                      ^                                  └──failure──> open (window doubled)

The backoff only computes the window; the breaker only keeps state; the store decides what is
a failure (a lost connection or a timeout, not an OOM reply from a healthy server).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class ExponentialBackoff:
    """Open-window length after the n-th consecutive failure: base * 2**(n-1), capped."""

    base_seconds: float = 0.5
    cap_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.base_seconds <= 0 or self.cap_seconds < self.base_seconds:
            raise ValueError(
                f"backoff needs 0 < base_seconds <= cap_seconds, got {self.base_seconds}, {self.cap_seconds}"
            )

    def compute(self, failures: int) -> float:
        return min(self.cap_seconds, self.base_seconds * 2 ** max(failures - 1, 0))


class CircuitBreaker:
    """Thread-safe breaker state; ``allow`` before a call, then ``record_success``/``record_failure``."""

    def __init__(self, backoff: ExponentialBackoff | None = None, failure_threshold: int = 1,
                 timer: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.backoff = backoff or ExponentialBackoff()
        self.failure_threshold = failure_threshold
        self._timer = timer
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0          # consecutive failures
        self._opened_at = 0.0
        self._window = 0.0
        self._probing = False
        self.times_opened = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == OPEN and self._timer() - self._opened_at >= self._window:
                return HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """May a call go to the server now? In half-open, only one caller probes."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN and self._timer() - self._opened_at >= self._window:
                self._state = HALF_OPEN
            if self._state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = CLOSED
            self._failures = 0
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._probing = False
            if self._state == HALF_OPEN or self._failures >= self.failure_threshold:
                if self._state != OPEN:
                    self.times_opened += 1
                self._state = OPEN
                self._opened_at = self._timer()
                self._window = self.backoff.compute(self._failures - self.failure_threshold + 1)

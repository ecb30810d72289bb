"""A clock the test moves by hand."""

from __future__ import annotations


class Clock:
    """A monotonic clock the test moves by hand (circuit breakers, TTLs)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

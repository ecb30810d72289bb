"""Bounded waits: poll for a condition, never sleep on a guess."""

from __future__ import annotations

import time
from typing import Any

EVENT_TIMEOUT_S = 10.0     # how long a test waits for something a server reports


def wait_until(condition: Any, what: str | None = None, timeout: float = EVENT_TIMEOUT_S,
               interval: float = 0.02) -> bool:
    """Poll ``condition`` until it holds, for at most ``timeout`` seconds (a bound, never a
    timing assertion). With ``what``, running out is an AssertionError naming what was awaited;
    without, the answer is whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            if what is not None:
                raise AssertionError(f"timed out waiting for {what}")
            return False
        time.sleep(interval)
    return True

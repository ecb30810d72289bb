"""Clocks the test moves by hand: a monotonic one (breakers, TTLs) and the wall clock that
templates and the key's time tag read."""

from __future__ import annotations

from typing import Any


class Clock:
    """A monotonic clock the test moves by hand (circuit breakers, TTLs)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeClock:
    """Stands in for ``datetime`` in transformers' strftime_now and in the key's time tag."""

    def __init__(self) -> None:
        from datetime import datetime

        self.base = datetime
        self.at = datetime(2026, 12, 4, 10, 0, 5)
        clock = self

        class Fake(datetime):
            @classmethod
            def now(cls, tz: Any = None) -> Any:  # noqa: ARG003 - the signature it replaces
                return clock.at

        self.fake = Fake

    def set(self, hour: int, minute: int, second: int) -> None:
        self.at = self.base(2026, 12, 4, hour, minute, second)


def fake_template_clock(monkeypatch: Any) -> FakeClock:
    """A FakeClock in place of ``datetime`` for transformers' strftime_now and the time tag."""
    import transformers.utils.chat_template_utils as ctu

    from prefix_cache.render import _template_clock as template_clock

    fake = FakeClock()
    monkeypatch.setattr(ctu, "datetime", fake.fake)
    monkeypatch.setattr(template_clock, "datetime", fake.fake)
    return fake

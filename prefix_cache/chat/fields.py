"""Checked request fields every API layer reads the same way: numbers in range, booleans, stop
strings, and the SpecPrefill extension knobs. Each bad value is an ``InvalidRequestError``
naming the field (a 400)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import engine_protocol as wire
from ..engine_protocol import SpecPrefillParams
from ..errors import InvalidRequestError

INVALID, UNSUPPORTED = "invalid_value", "unsupported_parameter"


def int_field(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequestError(f"{name} must be an integer >= {minimum}, got {value!r}",
                                  code=INVALID)
    return value


def float_field(body: Mapping[str, Any], name: str, low: float, high: float,
                low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (low < value if low_open else low <= value) or value > high:
        bound = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be a number in {bound}{low}, {high}], "
                                  f"got {value!r}", code=INVALID)
    return float(value)


def bool_field(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {value!r}", code=INVALID)
    return value


def stop_strings(value: Any, name: str, limit: int) -> tuple[str, ...]:
    """A string or a list of at most ``limit`` strings; empty ones dropped."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > limit \
            or not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError(f"{name} must be a string or a list of at most "
                                  f"{limit} strings", code=INVALID)
    return tuple(s for s in stops if s)


def specprefill_params(body: Mapping[str, Any]) -> SpecPrefillParams:
    """The extension fields ``specprefill``, ``specprefill_keep_pct``, ``specprefill_threshold``."""
    return SpecPrefillParams(
        enabled=bool_field(body, wire.SPECPREFILL),
        keep_pct=float_field(body, wire.SPECPREFILL_KEEP_PCT, 0.0, 1.0, low_open=True),
        threshold=int_field(body, wire.SPECPREFILL_THRESHOLD, 0),
    )

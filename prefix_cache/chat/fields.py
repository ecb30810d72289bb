"""Checked request fields every API layer reads the same way: numbers in range, booleans, stop
strings, and the SpecPrefill extension knobs. Each bad value is an ``InvalidRequestError``
naming the field (a 400)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..engine import protocol as wire
from ..engine.protocol import SpecPrefillParams
from ..errors import InvalidRequestError

INVALID, UNSUPPORTED = "invalid_value", "unsupported_parameter"
SEED_MAX = 2**64 - 1      # an engine's PRNG key is 64 bits: a larger seed cannot be honoured
INT32_MAX = 2**31 - 1     # counts (tokens, choices) an upstream stores in 32 bits
# OpenAI's documented ranges of a chat body's numbers, checked even when the body goes upstream
# as it came: a number out of range is the client's 400 here, never a replica's 500 that
# would count against it (``pool.py``). (name, low, high, integer)
RELAYED_NUMBERS: tuple[tuple[str, float, float, bool], ...] = (
    ("n", 1, 128, True),
    ("max_tokens", 1, INT32_MAX, True),
    ("max_completion_tokens", 1, INT32_MAX, True),
    ("seed", -2**63, SEED_MAX, True),
    ("temperature", 0.0, 2.0, False),
    ("top_p", 0.0, 1.0, False),
    ("presence_penalty", -2.0, 2.0, False),
    ("frequency_penalty", -2.0, 2.0, False),
    ("top_logprobs", 0, 20, True),
    ("top_k", -1, INT32_MAX, True),
    ("min_p", 0.0, 1.0, False),
)


def int_field(body: Mapping[str, Any], name: str, minimum: int,
              maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or (maximum is not None and value > maximum):
        within = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidRequestError(f"{name} must be an integer {within}, got {value!r}",
                                  code=INVALID)
    return value


def check_relayed_numbers(body: Mapping[str, Any]) -> None:
    """Every number of ``RELAYED_NUMBERS`` a body sets, in its range (InvalidRequestError
    naming the first one out of it), and ``logprobs`` a boolean."""
    for name, low, high, integer in RELAYED_NUMBERS:
        if body.get(name) is None:
            continue
        if integer:
            int_field(body, name, int(low), int(high))
        else:
            float_field(body, name, low, high)
    bool_field(body, "logprobs")


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

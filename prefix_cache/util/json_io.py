"""JSON bodies in and out, with integers kept exact at any size and nesting bounded.

orjson is fast but turns an integer beyond 64 bits into a float on parse and refuses it on
dump; a template renders such an integer digit for digit, so a float would give it another
render and let two requests share a key. Bodies are parsed by orjson (whose rules decide what is
valid JSON) and parsed again by the standard library only when a long run of digits shows there
may be such an integer; dumps falls back the same way.

Nesting is bounded where input is parsed, once, below what every later step accepts: orjson
parses 1024 levels but serializes only 254, msgpack (the key material) packs 511, the key
walk refuses past 256 and the standard library's parser and encoder recurse in Python. A body
nested deeper than ``MAX_DEPTH`` is refused at parse time, so no later step meets one.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# orjson keeps integers in [-2**63, 2**64) exact; anything longer than 18 digits may be outside.
# Found as a run of 19 zeros once every digit is mapped to "0" and every other byte to " ": a
# translate and a substring search, both C loops over the body (~20 us for 38 KB, where the
# regular expression ``\d{19}`` took ~300 us: it tries a match at every position).
_LONG_RUN = 19
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_ZEROS = b"0" * _LONG_RUN

MAX_DEPTH = 128               # containers within containers; real tool schemas use ~10
_ORJSON_DUMP_DEPTH = 254      # orjson.dumps raises past this many levels


class JSONInputError(ValueError):
    """Input that is not JSON we accept: invalid, or nested deeper than ``MAX_DEPTH``."""

    def __init__(self, message: str, code: str = "invalid_json") -> None:
        super().__init__(message)
        self.code = code


def loads(raw: bytes | str, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON; JSONInputError if it is not valid JSON or is nested past ``max_depth``."""
    data_bytes = raw.encode() if isinstance(raw, str) else raw
    try:
        data = orjson.loads(data_bytes)
    except orjson.JSONDecodeError as exc:
        raise JSONInputError(f"invalid JSON: {exc}") from None
    if _deeper_than(data_bytes, data, max_depth):
        raise JSONInputError(f"invalid JSON: nested more than {max_depth} levels deep",
                             code="json_too_deep")
    if not has_long_digit_run(data_bytes):
        return data
    return json.loads(data_bytes)  # nesting is bounded now: the recursive parser is safe


def has_long_digit_run(raw: bytes) -> bool:
    """Whether ``raw`` holds 19 digits in a row (where an integer orjson cannot keep may be)."""
    return _ZEROS in raw.translate(_DIGITS_AS_ZEROS)


def _deeper_than(raw: bytes, data: Any, max_depth: int) -> bool:
    """Whether ``data`` (parsed from ``raw``) nests more than ``max_depth`` containers."""
    if len(raw) < 2 * (max_depth + 1):
        return False  # too short to open and close that many containers
    # orjson serializes at most _ORJSON_DUMP_DEPTH levels: inside that many fewer extra lists,
    # it fails exactly when the value nests past max_depth -- one pass in C, no Python walk.
    wrapped = data
    for _ in range(_ORJSON_DUMP_DEPTH - max_depth):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        return True
    return False


def dumps(value: Any) -> bytes:
    """Serialize to compact JSON bytes, integers of any size included."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()

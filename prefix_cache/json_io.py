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
import re
from typing import Any

import orjson

# orjson keeps integers in [-2**63, 2**64) exact; anything longer than 18 digits may be outside.
_LONG_DIGITS = re.compile(rb"\d{19}")

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
    if _LONG_DIGITS.search(data_bytes) is None:
        return data
    return json.loads(data_bytes)  # nesting is bounded now: the recursive parser is safe


def _deeper_than(raw: bytes, data: Any, max_depth: int) -> bool:
    """Whether ``data`` (parsed from ``raw``) nests more than ``max_depth`` containers."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False  # too few containers to nest that deep (most bodies stop here)
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

"""JSON bodies in and out, with integers kept exact at any size.

orjson is fast but turns an integer beyond 64 bits into a float on parse and refuses it on
dump; a template renders such an integer digit for digit, so a float would give it another
render and let two requests share a key. Bodies are parsed by orjson (whose rules decide what is
valid JSON) and parsed again by the standard library only when a long run of digits shows there
may be such an integer; dumps falls back the same way.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

# orjson keeps integers in [-2**63, 2**64) exact; anything longer than 18 digits may be outside.
_LONG_DIGITS = re.compile(rb"\d{19}")


def loads(raw: bytes | str) -> Any:
    """Parse JSON; orjson.JSONDecodeError if it is not valid JSON."""
    data = orjson.loads(raw)
    if _LONG_DIGITS.search(raw.encode() if isinstance(raw, str) else raw) is None:
        return data
    return json.loads(raw)


def dumps(value: Any) -> bytes:
    """Serialize to compact JSON bytes, integers of any size included."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()

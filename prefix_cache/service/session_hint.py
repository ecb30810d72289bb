"""A conversation's id as the agent client gives it, for routing (``pool.py``): an agent whose
static prefix is shared with other sessions still needs its later turns on the replica holding
its conversation's KV.

The rule, first found wins: the body's ``prompt_cache_key`` (OpenAI's field; Codex sends its
session id there), the ``session_id`` inside the body's ``metadata.user_id`` when that is a
JSON object's text (Claude Code), the ``x-session-affinity`` header (opencode). Anything else,
an empty value or one longer than ``MAX_HINT_CHARS``, is no hint. A hint only picks among the
replicas the tenant's own routing would use (``routing.routing_key`` keeps tenants apart).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

MAX_HINT_CHARS = 256
HEADER = "x-session-affinity"


def _usable(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_HINT_CHARS else None


def session_hint(body: Any, headers: Mapping[str, str]) -> str | None:
    """The session id a client's request names (see the module docstring), or None."""
    if isinstance(body, dict):
        if (hint := _usable(body.get("prompt_cache_key"))) is not None:
            return hint
        metadata = body.get("metadata")
        user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
        if isinstance(user_id, str) and user_id.startswith("{") and len(user_id) < 4096:
            try:
                parsed = json.loads(user_id)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and (hint := _usable(parsed.get("session_id"))):
                return hint
    return _usable(headers.get(HEADER))

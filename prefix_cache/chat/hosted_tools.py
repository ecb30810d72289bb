"""Tools a client's API runs on its provider's side (hosted: web search, file search, a code
interpreter ...), found in a request, and what is done with them where the target cannot run
them.

Rule: a hosted tool is left out of the prompt wherever the request is converted (the engine,
a chat-only upstream), because an agent that may never call it must not lose its whole turn
to it (Codex sends ``web_search`` by default). What was left out is said in the
``x-prefix-cache-dropped-tools`` response header and a log line; an operator who wants the
request refused instead sets ``strict_hosted_tools`` (a 400 naming the tool). An upstream that
serves the API itself gets the body as it was sent, hosted tools included, and runs them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..errors import InvalidRequestError
from .fields import UNSUPPORTED

HEADER = "x-prefix-cache-dropped-tools"
# Responses' hosted tool types (``web_search`` has dated variants: a prefix).
RESPONSES_HOSTED = ("web_search", "file_search", "code_interpreter", "image_generation",
                    "computer_use", "mcp")
# Anthropic's server tools (dated types: a prefix): run by Anthropic, never by the client.
MESSAGES_HOSTED = ("web_search_", "web_fetch_", "code_execution_")

log = logging.getLogger("prefix_cache.service")  # rate-limited per kind (http.logs)


def is_hosted(kind: object, hosted: Sequence[str]) -> bool:
    """Whether a tool ``type`` names one of ``hosted`` (each a type or a type's prefix)."""
    return isinstance(kind, str) and any(kind.startswith(h) for h in hosted)


def left_out(dropped: Sequence[str], strict: bool, model: str) -> dict[str, str]:
    """The header saying which hosted tools were left out of the prompt (none: no header);
    with ``strict``, a 400 naming them instead."""
    if not dropped:
        return {}
    names = ", ".join(dropped)
    if strict:
        raise InvalidRequestError(f"tools: {names} run on the provider's side and cannot run "
                                  "here (strict_hosted_tools is on)", code=UNSUPPORTED)
    log.warning("hosted tools left out of the prompt for model %s: %s (the "
                "target cannot run them; strict_hosted_tools refuses such requests)", model, names)
    return {HEADER: ",".join(dropped)}

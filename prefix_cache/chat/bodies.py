"""Which API a body is in, and its conversation: what ``prefix-cache boundary`` reads from each
JSONL line (chat completions, Anthropic Messages or OpenAI Responses, told apart per line).

Detection, in order: a body with ``input`` and no ``messages`` is a Responses body; a body with
``messages`` is an Anthropic one when it shows a mark only Anthropic bodies have -- a top-level
``system``, ``stop_sequences``, a tool with an ``input_schema``, or a content block of type
tool_use, tool_result, image (with a ``source``), thinking, redacted_thinking or document --
and a chat body otherwise. A body with none of those marks means the same in both APIs except
for lists of text blocks (Anthropic joins them, chat passes the list to the template): name the
API (``--api messages``) for such bodies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidRequestError
from .anthropic_params import messages_conversation
from .conversation import Conversation
from .render_fields import chat_conversation
from .responses_params import parse_responses_body

APIS = ("chat", "messages", "responses")
ANTHROPIC_BLOCKS = frozenset(("tool_use", "tool_result", "image", "thinking", "redacted_thinking",
                              "document"))


def detect_api(body: Mapping[str, Any]) -> str:
    """"chat", "messages" or "responses" (see the module docstring)."""
    if "input" in body and "messages" not in body:
        return "responses"
    if "system" in body or "stop_sequences" in body:
        return "messages"
    tools = body.get("tools")
    if isinstance(tools, list) and any(isinstance(t, dict) and "input_schema" in t for t in tools):
        return "messages"
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and block.get("type") in ANTHROPIC_BLOCKS \
                    and (block["type"] != "image" or "source" in block):
                return "messages"
    return "chat"


def conversation_of(body: Mapping[str, Any], api: str = "auto") -> Conversation:
    """The conversation of a body of ``api`` ("auto": detected); InvalidRequestError or
    pydantic's ValidationError (both ValueErrors) naming what is wrong."""
    if api == "auto":
        api = detect_api(body)
    if api == "messages":
        return messages_conversation(body)
    if api == "responses":
        if body.get("previous_response_id") is not None:
            raise InvalidRequestError("previous_response_id refers to a server's stored "
                                      "responses: give the whole conversation as input")
        return parse_responses_body(body, lambda _: None).call.conversation
    if api != "chat":
        raise ValueError(f"api {api!r} is not one of auto, {', '.join(APIS)}")
    return chat_conversation(body)

"""Request validation and the static part of a conversation: the leading system/developer run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any

import orjson

from ..errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
STATIC_ROLES = frozenset(("system", "developer"))

# apply_chat_template's own parameters: a kwarg with one of these names would either collide with
# the call we make or change how the prompt is tokenized, so it is refused rather than ignored.
RESERVED_KWARGS = frozenset((
    "conversation", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
))


def count_static(messages: Sequence[Mapping[str, Any]]) -> int:
    """Number of leading messages whose role is system or developer."""
    n = 0
    for message in messages:
        if message.get("role") not in STATIC_ROLES:
            break
        n += 1
    return n


def dynamic_chars(messages: Sequence[Mapping[str, Any]], n_static: int) -> int:
    """About how much text the messages after the static run give the template: a string
    content's length, or the JSON size of a message with anything else (parts, tool calls).
    A measure of the work a render and a tokenization of them take, not a limit."""
    total = 0
    for message in messages[n_static:]:
        content = message.get("content")
        if isinstance(content, str) and len(message) <= 2:  # role and content only
            total += len(content)
            continue
        try:
            total += len(orjson.dumps(message, default=repr))
        except TypeError:  # an integer past 64 bits, a lone surrogate: measured another way
            total += len(repr(message))
    return total


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the shape the templates rely on; raise InvalidRequestError naming the bad field."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string, a list of content parts or null"
            )
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise InvalidRequestError(f"messages[{i}].content[{j}] must be an object")
    return messages


def validate_tools(tools: Any, frozen: bool = False) -> list[dict[str, Any]] | None:
    """Tools are a list of JSON-schema objects, or None. ``[]`` stays ``[]``: templates that
    test ``tools is not none``, and transformers' choice of a ``tool_use`` named template, tell
    it from None. A ``frozen`` tool list was checked when it was frozen."""
    if tools is None or frozen:
        return tools  # type: ignore[no-any-return]
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of tool objects")
    if all(map(isinstance, tools, repeat(dict))):  # one C loop: a hit checks 64 tools each time
        return tools
    i = next(i for i, tool in enumerate(tools) if not isinstance(tool, dict))
    raise InvalidRequestError(f"tools[{i}] must be an object")


def validate_kwargs(kwargs: Any) -> dict[str, Any]:
    """chat_template_kwargs: an object of template variables, none of them reserved."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object")
    for name in kwargs:
        if not isinstance(name, str):
            raise InvalidRequestError("chat_template_kwargs keys must be strings")
        if name in RESERVED_KWARGS:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {name!r}: it is a parameter of the render itself"
            )
    return kwargs

"""A chat completion's fields that bind the output (``response_format``, ``tool_choice``,
``parallel_tool_calls``), checked in shape when it is generated here; each bad one is an
``InvalidRequestError`` naming it. What they ask is the engine's to honour or refuse."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidRequestError
from .fields import INVALID, bool_field

FORMAT_KINDS = ("text", "json_object", "json_schema")
CHOICE_WORDS = ("auto", "none", "required")


def output_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The binding fields a body sets, checked in shape (not sent: left out)."""
    options: dict[str, Any] = {}
    if body.get("response_format") is not None:
        options["response_format"] = response_format(body["response_format"])
    if body.get("tool_choice") is not None:
        options["tool_choice"] = tool_choice(body["tool_choice"])
    parallel = bool_field(body, "parallel_tool_calls")
    if parallel is not None:
        options["parallel_tool_calls"] = parallel
    return options


def response_format(value: Any) -> dict[str, Any]:
    """``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name", "schema"?, "strict"?}}``."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in FORMAT_KINDS:
        raise InvalidRequestError("response_format.type must be one of "
                                  f"{', '.join(FORMAT_KINDS)}", code=INVALID)
    if kind != "json_schema":
        return {"type": kind}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequestError("response_format.json_schema must be an object with a "
                                  "\"name\"", code=INVALID)
    if not isinstance(spec.get("schema", {}), dict):
        raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema "
                                  "object", code=INVALID)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequestError("response_format.json_schema.strict must be a boolean",
                                  code=INVALID)
    return {"type": kind, "json_schema": spec}


def tool_choice(value: Any) -> str | dict[str, Any]:
    """"auto", "none", "required" or ``{"type": "function", "function": {"name": ...}}``."""
    if value in CHOICE_WORDS:
        return str(value)
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" \
            or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError("tool_choice must be \"auto\", \"none\", \"required\" or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                                  code=INVALID)
    return {"type": "function", "function": {"name": function["name"]}}

"""The chat-template conversation every API is converted to, and the pieces the converters share.

A ``Conversation`` is exactly what a chat template is given -- ``messages``, ``tools``,
``chat_template_kwargs`` -- so the boundary is cut in the render of this and nothing else. The
shapes follow the OpenAI chat convention that the templates are written for (and that
``/v1/chat/completions`` passes through as sent):

- a tool is ``{"type": "function", "function": {"name", "description"?, "parameters"}}``;
- an assistant's tool calls are ``tool_calls: [{"id", "type": "function", "function":
  {"name", "arguments"}}]`` with ``arguments`` the JSON object itself (transformers' convention:
  nearly every template prints it with ``tojson``; a string would be quoted twice by many) and
  ``content`` ``""`` when the turn has no text (``None`` breaks Qwen3, gpt-oss, Phi-3.5 ...);
- a tool result is ``{"role": "tool", "tool_call_id", "content"}`` with its text; its images
  follow as a user turn;
- text-only content is one string; content with images is a list of ``{"type": "text"}`` and
  ``{"type": "image_url", "image_url": {"url"}}`` parts.

For an upstream that speaks only chat completions, ``chat_wire_messages`` gives the same
messages in the wire format (``arguments`` as a JSON string, as OpenAI's API sends them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..util import json_io

MessageDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Conversation:
    """What the chat template renders, and how (a request-level template, and the
    ``apply_chat_template`` flags that end the prompt: ``render_fields``)."""

    messages: list[MessageDict]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Template variables an API's own field sets (Anthropic ``thinking``, Responses'
    # ``reasoning.effort``): rendered only by a template that reads them (``for_template``).
    template_switches: dict[str, Any] | None = None


def for_template(c: Conversation, tokenizer: Any) -> Conversation:
    """The conversation with its template switches moved into ``chat_template_kwargs`` where
    the template it renders with reads them (names it), the client's own kwargs winning; a
    template that does not read a switch renders, and caches, as if it were not sent."""
    if not c.template_switches:
        return c
    from ..render.render import unwrap_tokenizer

    template = c.chat_template or getattr(unwrap_tokenizer(tokenizer), "chat_template", None)
    read = {k: v for k, v in c.template_switches.items()
            if isinstance(template, str) and k in template}
    if not read:
        return replace(c, template_switches=None)
    return replace(c, chat_template_kwargs={**read, **(c.chat_template_kwargs or {})},
                   template_switches=None)


def function_tool(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    """A tool in the template's shape; a missing description or parameters schema is left
    out, as chat clients leave it out."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def arguments_object(arguments: str) -> Any:
    """Tool-call arguments sent as JSON text, as the template is given them: the object they
    encode, or the text itself when it is not a JSON object (a model's malformed call)."""
    try:
        value = json_io.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def content_of(parts: Sequence[dict[str, Any]], separator: str = "\n") -> str | list[Any]:
    """Message content from text and image parts: one string when all are text (joined with
    ``separator``), else the list of parts."""
    if all(p["type"] == "text" for p in parts):
        return separator.join(p["text"] for p in parts)
    return list(parts)


def assistant_message(content: str | list[Any], calls: Sequence[dict[str, Any]]) -> MessageDict:
    message: MessageDict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def tool_result(call_id: str, parts: Sequence[dict[str, Any]]) -> list[MessageDict]:
    """A tool's result: a "tool" message with its text (templates render a tool result as
    text), then its images, if any, as a user turn (as vLLM does)."""
    texts = [p for p in parts if p["type"] == "text"]
    images = [p for p in parts if p["type"] != "text"]
    messages: list[MessageDict] = [{"role": "tool", "tool_call_id": call_id,
                                    "content": content_of(texts)}]
    if images:
        messages.append({"role": "user", "content": images})
    return messages


def append_call(messages: list[MessageDict], call: dict[str, Any]) -> None:
    """Add a tool call to the assistant turn just before it, or open a turn with no text."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append(assistant_message("", [call]))


def chat_wire_messages(messages: Sequence[MessageDict]) -> list[MessageDict]:
    """The messages as an OpenAI chat body carries them: tool-call arguments as JSON text, and
    no ``reasoning_content`` (a field of the template's, not of OpenAI's messages: an upstream
    gets what it got before Messages and Responses reasoning was rendered)."""
    out = []
    for message in messages:
        if "reasoning_content" in message:
            message = {k: v for k, v in message.items() if k != "reasoning_content"}
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_wire_call(c) for c in calls]}
        out.append(message)
    return out


def _wire_call(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    if not isinstance(arguments, str):
        arguments = json_io.dumps(arguments).decode()
    return {**call, "function": {**call["function"], "arguments": arguments}}



SYSTEM_ROLES = ("system", "developer")


def fold_late_system(messages: list[MessageDict], static: int | None = None
                     ) -> list[MessageDict]:
    """The conversation with every system or developer message that comes after the first
    other message folded into a user turn, so every template renders it.

    Rule: the leading run of system/developer messages (the static prefix) is left as it is.
    A later one is not a static message and must not become one; many templates raise on a
    system message after the first (Mistral, Gemma, Llama-2 ...) or on two user turns in a
    row, so its text joins the user turn just before it (after that turn's text), else the
    next user turn (before its text), else it becomes a user turn of its own. Texts join
    with ``"\\n"``, as a turn's text blocks do. ``static``: how many leading messages are the
    static prefix, where the API says (Anthropic: only the top-level ``system``); None: the
    leading run of system/developer messages."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in SYSTEM_ROLES \
            and (static is None or lead < static):
        lead += 1
    out = messages[:lead]
    pending: list[dict[str, Any]] = []   # late system parts waiting for the next user turn
    for message in messages[lead:]:
        if message["role"] in SYSTEM_ROLES:
            last = out[-1] if len(out) > lead else None
            if last is not None and last["role"] == "user" and not pending:
                out[-1] = {**last, "content": content_of([*_parts_of(last["content"]),
                                                          *_parts_of(message["content"])])}
            else:
                pending.extend(_parts_of(message["content"]))
            continue
        if message["role"] == "user" and pending:
            message = {**message, "content": content_of([*pending,
                                                          *_parts_of(message["content"])])}
            pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": content_of(pending)})
    return out


def _parts_of(content: str | list[Any]) -> list[dict[str, Any]]:
    return [text_part(content)] if isinstance(content, str) else list(content)

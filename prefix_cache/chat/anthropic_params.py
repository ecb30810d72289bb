"""An Anthropic Messages body, checked, as the chat-template conversation and a neutral call.

The mapping (docs/agent-apis.md has it with examples):

    system (string, or text blocks joined with "")      -> one leading "system" message
    messages[].content string                           -> that string
    text blocks of a turn (joined with "\\n")            -> the message's content string
    image blocks (base64 or url source)                 -> image_url parts (data: URLs)
    assistant tool_use blocks                           -> the turn's tool_calls (arguments: the input)
    user tool_result blocks                             -> "tool" messages, in order, before
                                                           the turn's other content
    tools [{name, description, input_schema}]           -> function tools {name, description, parameters}

The joins are vLLM's, so a vLLM upstream renders the same static text. An assistant turn's
thinking blocks are its ``reasoning_content`` (rendered where the template renders it). Not
rendered: redacted_thinking blocks, cache_control, citations, is_error, metadata; a system text block
that starts with Claude Code's ``x-anthropic-billing-header`` (a per-request hash: it would make
every request a miss; vLLM drops it too). Refused with a 400: roles other than user/assistant,
block types other than those above (documents, server tools' blocks), image sources other than
base64/url, server tools (a ``type`` other than "custom"), and a final assistant message
(Anthropic's prefill continues that text; a chat template renders a new turn after it).
``thinking`` sets the template's ``enable_thinking`` where the template reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ..engine.protocol import SamplingParams
from ..errors import InvalidRequestError
from .agent_call import AgentCall, sent_fields, sent_options
from .conversation import (
    Conversation,
    MessageDict,
    append_call,
    assistant_message,
    content_of,
    fold_late_system,
    function_tool,
    image_part,
    text_part,
    tool_call,
    tool_result,
)
from .fields import specprefill_params
from .hosted_tools import MESSAGES_HOSTED, is_hosted

BILLING_HEADER = "x-anthropic-billing-header"
MAX_STOP_SEQUENCES = 16
# "system" inside messages: Claude Code sends its environment block there, after the first
# user turn (Anthropic's API takes it); it is folded into a user turn (fold_late_system).
ROLES = ("user", "assistant", "system")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Anthropic's server-side features: an upstream that serves Messages may run them; nothing
# here can (refused wherever the request is converted).
NATIVE_ONLY = ("mcp_servers", "container")


class MessagesConversation(BaseModel):
    """The fields of a Messages body that make its conversation, typed (content blocks are
    checked below, with messages that name the block)."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(min_length=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(MessagesConversation):
    """``POST /v1/messages``: the fields read, typed."""

    model: StrictStr
    max_tokens: StrictInt = Field(ge=1)
    tool_choice: dict[str, Any] | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    stop_sequences: list[StrictStr] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


def messages_conversation(body: Mapping[str, Any]) -> Conversation:
    """The conversation of a Messages body (its generation fields are not read)."""
    return _conversation(MessagesConversation.model_validate(body))


def _conversation(req: MessagesConversation) -> Conversation:
    messages: list[MessageDict] = []
    system = _system(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        _message(message, f"messages[{i}]", messages)
    if req.messages[-1].get("role") == "assistant":
        raise InvalidRequestError("the last message is the assistant's: a prefill to continue "
                                  "is not supported (end with a user message)")
    tools = None if req.tools is None else [
        _tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)
        if not is_hosted(t.get("type"), MESSAGES_HOSTED)]
    if req.tools and not tools:  # only hosted tools: as a request without tools
        tools = None
    return Conversation(fold_late_system(messages, 1 if system else 0), tools,
                        req.chat_template_kwargs, template_switches=_thinking(req.thinking))


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """``thinking`` as the template's switch: ``disabled`` turns it off, ``enabled`` and
    ``adaptive`` on; not sent, the template's default (a local model's, not Claude's "off")."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise InvalidRequestError('thinking.type must be "enabled", "disabled" or "adaptive"')
    return {"enable_thinking": kind != "disabled"}


def parse_messages_body(body: Mapping[str, Any]) -> AgentCall:
    """The call an Anthropic Messages body asks for; InvalidRequestError (or pydantic's
    ValidationError) naming the first bad field."""
    req = MessagesRequest.model_validate(body)
    conversation = _conversation(req)
    sampling = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop=tuple(s for s in req.stop_sequences or () if s),
    )
    options = {**sent_options(temperature=req.temperature, top_p=req.top_p),
               **_tool_choice(req.tool_choice)}
    refusal = None
    if req.top_k is not None:
        options["top_k"] = req.top_k
        refusal = "top_k is not supported by this engine"
    output_format = (req.output_config or {}).get("format")
    if output_format is not None:  # honoured by an engine with constrained decoding
        options["response_format"] = _response_format(output_format)
    return AgentCall(
        model=req.model, conversation=conversation,
        sampling=sampling, specprefill=specprefill_params(body), stream=bool(req.stream),
        chat_options=options, engine_refusal=refusal,
        native_only=sent_fields(body, NATIVE_ONLY), hosted_tools=tuple(
            str(t["type"]) for t in req.tools or () if is_hosted(t.get("type"), MESSAGES_HOSTED)),
    )


def _response_format(output_format: Any) -> dict[str, Any]:
    """Anthropic's ``output_config.format`` as a chat completion's ``response_format``."""
    if not isinstance(output_format, dict) or output_format.get("type") != "json_schema" \
            or not isinstance(output_format.get("schema"), dict):
        raise InvalidRequestError("output_config.format must be {\"type\": \"json_schema\", "
                                  "\"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output",
                                                   "schema": output_format["schema"]}}


def _system(system: str | list[dict[str, Any]] | None) -> str:
    if not isinstance(system, list):
        return system or ""
    texts = []
    for i, block in enumerate(system):
        text = _text(block, f"system[{i}]")
        if not text.startswith(BILLING_HEADER):
            texts.append(text)
    return "".join(texts)


def _system_text(content: Any, where: str) -> str:
    """A system message's text: a string, or text blocks joined with "\\n" (a turn's join)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InvalidRequestError(f"{where}.content must be a string or a non-empty list of "
                                  "text blocks")
    return "\n".join(_text(b, f"{where}.content[{j}]") for j, b in enumerate(content))


def _text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise InvalidRequestError(f"{where} must be a text block {{\"type\": \"text\", "
                                  f"\"text\": ...}}")
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}.text must be a string")
    return text


def _message(message: dict[str, Any], where: str, out: list[MessageDict]) -> None:
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}")
    content = message.get("content")
    if role == "system":  # Claude Code's environment block, mid-conversation
        out.append({"role": "system", "content": _system_text(content, where)})
        return
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list) or not content:
        raise InvalidRequestError(f"{where}.content must be a string or a non-empty list of "
                                  "content blocks")
    blocks = [_block(b, f"{where}.content[{j}]") for j, b in enumerate(content)]
    if role == "assistant":
        _assistant(blocks, where, out)
    else:
        _user(blocks, where, out)


def _block(block: Any, where: str) -> dict[str, Any]:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequestError(f"{where} must be a content block with a 'type'")
    return block


def _user(blocks: list[dict[str, Any]], where: str, out: list[MessageDict]) -> None:
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        if parts:
            out.append({"role": "user", "content": content_of(parts)})
            parts.clear()

    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "tool_result":
            flush()
            _tool_result(block, at, out)
        elif kind in ("text", "image"):
            _part(block, at, parts)
        else:
            raise InvalidRequestError(f"{at}: a {kind!r} block is not supported in a user turn "
                                      "(text, image and tool_result are)")
    flush()


def _assistant(blocks: list[dict[str, Any]], where: str, out: list[MessageDict]) -> None:
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            _part(block, at, texts)
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input")
            if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name
                    and isinstance(args, dict)):
                raise InvalidRequestError(f"{at}: a tool_use block needs a string id and name "
                                          "and an object input")
            calls.append(tool_call(call_id, name, args))
        elif kind not in ("thinking", "redacted_thinking"):  # redacted: nothing to render
            raise InvalidRequestError(f"{at}: a {kind!r} block is not supported in an "
                                      "assistant turn (text, tool_use and thinking are)")
    message = assistant_message(content_of(texts) if texts else "", [])
    if thoughts:   # the template decides where it renders it (most only in the last tool loop)
        message["reasoning_content"] = "\n".join(thoughts)
    out.append(message)
    for call in calls:
        append_call(out, call)


def _part(block: dict[str, Any], where: str, parts: list[dict[str, Any]]) -> None:
    if block["type"] == "text":
        text = _text(block, where)
        if text:  # empty text blocks add nothing (vLLM skips them too)
            parts.append(text_part(text))
    elif block["type"] == "image":
        parts.append(image_part(_image_url(block.get("source"), where)))
    else:
        raise InvalidRequestError(f"{where}: only text and image blocks may be here")


def _image_url(source: Any, where: str) -> str:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) \
            and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise InvalidRequestError(f"{where}.source must be {{\"type\": \"base64\", \"media_type\", "
                              "\"data\"} or {\"type\": \"url\", \"url\"}")


def _tool_result(block: dict[str, Any], where: str, out: list[MessageDict]) -> None:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"{where}.tool_use_id must be a non-empty string")
    content = block.get("content", "")
    if content is None or isinstance(content, str):
        out.extend(tool_result(call_id, [text_part(content or "")]))
        return
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of text and "
                                  "image blocks")
    parts: list[dict[str, Any]] = []
    for k, item in enumerate(content):
        _part(_block(item, f"{where}.content[{k}]"), f"{where}.content[{k}]", parts)
    out.extend(tool_result(call_id, parts))


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise InvalidRequestError(f"{where}: the tool type {kind!r} is not supported; custom "
                                  "tools (name, description, input_schema) and server tools "
                                  "(left out) are")
    name, description, schema = tool.get("name"), tool.get("description"), tool.get("input_schema")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name must be a non-empty string")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description must be a string")
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where}.input_schema must be a JSON schema object")
    return function_tool(name, description, schema)


def _tool_choice(choice: dict[str, Any] | None) -> dict[str, Any]:
    """tool_choice (and disable_parallel_tool_use) in chat completions' terms."""
    if choice is None:
        return {}
    kind = choice.get("type")
    options: dict[str, Any] = {}
    if kind in TOOL_CHOICES:
        options["tool_choice"] = TOOL_CHOICES[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        options["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise InvalidRequestError("tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"}"
                                  " or {\"type\": \"tool\", \"name\": ...}")
    if choice.get("disable_parallel_tool_use") is True:
        options["parallel_tool_calls"] = False
    return options

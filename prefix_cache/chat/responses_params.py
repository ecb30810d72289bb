"""An OpenAI Responses body, checked, as the chat-template conversation and a neutral call.

The mapping (docs/agent-apis.md has it with examples):

    instructions                                  -> one leading "system" message
    the items of previous_response_id             -> the messages before this input (that
                                                     response's instructions are not carried
                                                     over, as in OpenAI's API)
    input string                                  -> one "user" message
    message items (role system, developer, user, assistant; content string or parts)
                                                  -> messages of that role; input_text,
                                                     output_text and refusal parts joined
                                                     with "\\n"; input_image -> image_url parts
    function_call items                           -> tool_calls of the assistant turn before
                                                     them (arguments: the JSON object they encode)
    function_call_output items                    -> "tool" messages
    tools [{type: function, name, description, parameters}]
                                                  -> function tools {name, description, parameters}

A reasoning item is the next assistant turn's ``reasoning_content`` (rendered where the template
renders it). Not rendered: ``metadata``, ``truncation``, ``user``. To an
upstream that speaks only chat completions: ``text.format`` as ``response_format``,
``reasoning.effort`` as ``reasoning_effort``, ``text.verbosity`` as ``verbosity``, and the
sampling fields only when sent. Refused with a 400: tools other than function tools (built-in
tools run on OpenAI's side), item types other than those above (item_reference, built-in tool
calls), input_file and file_id images, ``background``, ``conversation``, ``prompt``; on the
in-process engine, ``text.verbosity``. ``reasoning.effort`` sets the template's switches
(``enable_thinking``, gpt-oss's ``reasoning_effort``) where the template reads them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ..engine.protocol import SamplingParams
from ..errors import InvalidRequestError
from ..http.errors import BadRequest
from .agent_call import AgentCall, sent_fields, sent_options
from .conversation import (
    Conversation,
    MessageDict,
    append_call,
    arguments_object,
    content_of,
    fold_late_system,
    function_tool,
    image_part,
    text_part,
    tool_call,
    tool_result,
)
from .fields import specprefill_params
from .hosted_tools import RESPONSES_HOSTED, is_hosted
from .responses_store import StoredResponse

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
NOT_SUPPORTED = ("background", "conversation", "prompt")
NAMESPACE_SEPARATOR = "."
# Honoured only by an upstream that serves Responses (no chat-completion equivalent, no engine
# support): refused wherever the request is converted.
NATIVE_ONLY = ("max_tool_calls", "top_logprobs")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields read, typed (input items are checked below, with
    messages that name the item)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    """A Responses request: the neutral call, the request as typed (its fields are echoed in
    the response), and the items this turn adds to the conversation."""

    call: AgentCall
    request: ResponsesRequest
    history: list[Any]          # the items of previous_response_id's conversation
    input_items: list[Any]      # this request's input, as items
    # False when previous_response_id is not known here and the request goes as it is to an
    # upstream that keeps its own responses (it decides; this turn is not kept here).
    previous_known: bool = True
    # A namespace's functions by the name the prompt gives them: (namespace, name) as sent.
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def store(self) -> bool:
        return self.request.store is not False and self.previous_known

    def echo(self) -> dict[str, Any]:
        """The request's fields as a response object repeats them (OpenAI's defaults where
        the request left them out)."""
        req = self.request
        return {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls
            is not False, "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning, "store": self.store,
            "temperature": self.call.sampling.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": self.call.sampling.top_p, "truncation": req.truncation or "disabled",
            "user": req.user,
        }

    def conversation_items(self, response: Mapping[str, Any]) -> list[Any]:
        """The items a later ``previous_response_id`` continues from: the earlier turns, this
        input and ``response``'s output."""
        return [*self.history, *self.input_items, *response.get("output", [])]

    def record(self, response: Mapping[str, Any]) -> StoredResponse:
        """What is kept of this turn: ``response``, its conversation, its input items (each
        given an id, which ``input_items`` lists and pages by)."""
        inputs = [item if not isinstance(item, dict) or "id" in item
                  else {"id": new_item_id(item), **item} for item in self.input_items]
        start = len(self.history)
        return StoredResponse(dict(response), [*self.history, *inputs,
                                               *response.get("output", [])],
                              start, start + len(inputs))


def parse_responses_body(body: Mapping[str, Any],
                         history_of: Callable[[str], list[Any] | None], *,
                         forward_unknown: bool = False) -> ResponsesCall:
    """The call a Responses body asks for. ``history_of(id)`` gives a stored response's items
    (None: unknown to this tenant: a 400 ``previous_response_not_found``, OpenAI's answer --
    or, with ``forward_unknown``, a call without that history, for an upstream that keeps
    responses itself to resolve)."""
    req = ResponsesRequest.model_validate(body)
    for name in NOT_SUPPORTED:
        if body.get(name) not in (None, False):
            raise InvalidRequestError(f"{name} is not supported by this server",
                                      code="unsupported_parameter")
    history: list[Any] = []
    known = True
    if req.previous_response_id is not None:
        found = history_of(req.previous_response_id)
        known = found is not None
        if found is None and not forward_unknown:
            raise BadRequest(f"Previous response with id {req.previous_response_id!r} not "
                             "found.", code="previous_response_not_found",
                             param="previous_response_id")
        history = found or []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) \
        else list(req.input)
    messages: list[MessageDict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    for i, item in enumerate(history):
        _item(item, f"the items of {req.previous_response_id}[{i}]", messages)
    for i, item in enumerate(items):
        _item(item, f"input[{i}]", messages)
    if not messages:
        raise InvalidRequestError("input must not be empty")
    tools, hosted, namespaces = _tools(req.tools)
    sampling = SamplingParams(
        max_tokens=req.max_output_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
    )
    options = sent_options(temperature=req.temperature, top_p=req.top_p,
                           response_format=_response_format(req.text),
                           verbosity=(req.text or {}).get("verbosity"),
                           reasoning_effort=_reasoning_effort(req.reasoning))
    if req.tool_choice is not None:
        options["tool_choice"] = _tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        options["parallel_tool_calls"] = req.parallel_tool_calls
    conversation = Conversation(fold_late_system(messages), tools, req.chat_template_kwargs,
                                template_switches=_effort_switches(options.get(
                                    "reasoning_effort")))
    call = AgentCall(model=req.model, conversation=conversation,
                     sampling=sampling, specprefill=specprefill_params(body),
                     stream=bool(req.stream), chat_options=options,
                     engine_refusal=_engine_refusal(options),
                     native_only=sent_fields(body, NATIVE_ONLY), hosted_tools=hosted)
    return ResponsesCall(call, req, history, items, known, namespaces)


def new_item_id(item: Mapping[str, Any]) -> str:
    """An id for an input item that came without one, prefixed as OpenAI's are."""
    prefix = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    return f"{prefix.get(item.get('type'), 'msg')}_{uuid.uuid4().hex}"


def _item(item: Any, where: str, out: list[MessageDict]) -> None:
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{where} must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}")
        text = _content(content, f"{where}.content")
        last = out[-1] if out else None
        if (role == "assistant" and last is not None and last["role"] == "assistant"
                and "reasoning_content" in last and not last["content"]
                and "tool_calls" not in last):
            last["content"] = text    # the answer after its reasoning item: one turn
        else:
            out.append({"role": role, "content": text})
    elif kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name
                and isinstance(arguments, str)):
            raise InvalidRequestError(f"{where}: a function_call needs string call_id, name "
                                      "and arguments")
        namespace = item.get("namespace")
        if namespace is not None and not (isinstance(namespace, str) and namespace):
            raise InvalidRequestError(f"{where}.namespace must be a non-empty string")
        append_call(out, tool_call(call_id, qualified(namespace, name) if namespace else name,
                                   arguments_object(arguments)))
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{where}.call_id must be a non-empty string")
        out.extend(tool_result(call_id, _parts(output, f"{where}.output")))
    elif kind == "reasoning":   # the next assistant turn's reasoning_content
        text = _reasoning_text(item)
        if text:
            out.append({"role": "assistant", "content": "", "reasoning_content": text})
    else:
        raise InvalidRequestError(f"{where}: items of type {kind!r} are not supported (message, "
                                  "function_call, function_call_output and reasoning are)")


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary (what a client
    that kept it sends back; encrypted content has nothing this server can read)."""
    for field in ("content", "summary"):
        texts = [p.get("text") for p in item.get(field) or () if isinstance(p, dict)]
        if any(isinstance(t, str) and t for t in texts):
            return "\n".join(t for t in texts if isinstance(t, str))
    return ""


def _content(content: Any, where: str) -> str | list[Any]:
    return content if isinstance(content, str) else content_of(_parts(content, where))


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [text_part(content)]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get(TEXT_PARTS[kind]), str):
            parts.append(text_part(part[TEXT_PARTS[kind]]))
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append(image_part(part["image_url"]))
        else:
            raise InvalidRequestError(f"{where}[{j}]: only input_text, output_text, refusal and "
                                      "input_image (with an image_url) parts are supported")
    return parts


def qualified(namespace: str, name: str) -> str:
    """The name a namespace's function has in the prompt (templates list flat functions)."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _tools(tools: list[dict[str, Any]] | None
           ) -> tuple[list[dict[str, Any]] | None, tuple[str, ...], dict[str, tuple[str, str]]]:
    """The function tools the template lists, the hosted tools left out (their types), and
    each namespace's functions by their name in the prompt.

    Rule: a function tool is listed as it is; a namespace (Codex's named group of function
    tools) lists each of its functions as ``namespace.name``, so two namespaces may hold the
    same name, and a call of one goes back with ``name`` and ``namespace`` as sent; a hosted
    tool (``hosted_tools``) is left out; any other type is a 400."""
    if tools is None:
        return None, (), {}
    out: list[dict[str, Any]] = []
    hosted: list[str] = []
    namespaces: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(tools):
        kind, where = tool.get("type"), f"tools[{i}]"
        if kind == "namespace":
            name, members = tool.get("name"), tool.get("tools")
            if not isinstance(name, str) or not name or not isinstance(members, list):
                raise InvalidRequestError(f"{where}: a namespace needs a name and a list of "
                                          "tools")
            for j, member in enumerate(members):
                function = _tool(member, f"{where}.tools[{j}]")
                short = function["function"]["name"]
                function["function"]["name"] = qualified(name, short)
                namespaces[function["function"]["name"]] = (name, short)
                out.append(function)
        elif is_hosted(kind, RESPONSES_HOSTED):
            hosted.append(str(kind))
        else:
            out.append(_tool(tool, where))
    # Only hosted tools: the prompt lists none, as for a request without tools.
    return (None if hosted and not out else out), tuple(hosted), namespaces


def _tool(tool: Any, where: str) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise InvalidRequestError(f"{where}: the tool type {kind!r} is not supported; function "
                                  "tools, namespaces of them and hosted tools (left out) are")
    name, description, parameters = tool.get("name"), tool.get("description"), \
        tool.get("parameters")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name must be a non-empty string")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.parameters must be a JSON schema object")
    return function_tool(name, description, parameters)


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    """tool_choice in chat completions' terms."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError("tool_choice must be \"auto\", \"none\", \"required\" or "
                              "{\"type\": \"function\", \"name\": ...}")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as a chat completion's ``response_format`` (None: plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
            and isinstance(fmt.get("name"), str) and isinstance(fmt.get("schema"), dict)):
        raise InvalidRequestError("text.format must be {\"type\": \"text\"}, {\"type\": "
                                  "\"json_object\"} or {\"type\": \"json_schema\", \"name\", "
                                  "\"schema\", \"strict\"?, \"description\"?}")
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise InvalidRequestError("reasoning.effort must be a string")
    return effort


def _effort_switches(effort: str | None) -> dict[str, Any] | None:
    """``reasoning.effort`` as the template's switches: ``none`` and ``minimal`` turn
    ``enable_thinking`` off, the others on; low/medium/high are also gpt-oss's
    ``reasoning_effort``."""
    if effort is None:
        return None
    switches: dict[str, Any] = {"enable_thinking": effort not in ("none", "minimal")}
    if effort in ("low", "medium", "high"):
        switches["reasoning_effort"] = effort
    return switches


# Options an in-process engine cannot honour, by the Responses field the client named.
# (text.format goes as response_format: an engine with constrained decoding honours it, the
# others refuse it naming text.format.)
# reasoning.effort is no option there: it sets the template's switches (``_effort_switches``).
ENGINE_REFUSED = {"verbosity": "text.verbosity"}


def _engine_refusal(options: Mapping[str, Any]) -> str | None:
    for option, named in ENGINE_REFUSED.items():
        if option in options:
            return f"{named} is not supported by this engine"
    return None

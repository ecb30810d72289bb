"""Request and response bodies of the sidecar's endpoints.

Request models check the types of the fields the sidecar reads and let every other field
through (``extra="allow"``): OpenAI bodies grow new fields all the time, and the upstream, not
the sidecar, is the judge of those. Roles and content parts are checked by
``prefix_cache.cache.messages`` (the same rules as the library's), so their messages say which one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from ..chat.anthropic_params import MessagesConversation


class ChatRequest(BaseModel):
    """An OpenAI chat completion body: the fields the boundary depends on, typed."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: StrictBool | None = None


class BoundaryRequest(ChatRequest):
    """``POST /v1/prefix/boundary``: a chat body, optionally asking for the prompt ids too."""

    return_prompt_ids: StrictBool = False


def check_chat_body(data: dict[str, Any]) -> None:
    """A chat completion body checked as ``ChatRequest`` checks it (its errors where it fails),
    the same on both servers (``api.pipeline.admit``); pydantic's walk skipped where it
    certainly accepts (see ``boundary_fields``)."""
    if not _plain_chat(data):
        ChatRequest.model_validate(data)


def boundary_fields(data: dict[str, Any]) -> tuple[str | None, bool]:
    """``model`` and ``return_prompt_ids`` of a boundary body checked as ``BoundaryRequest``
    checks it (its errors where it fails). A JSON body whose checked fields have the types the
    model takes as they are skips pydantic's walk, which copies every message and tool (~9 us
    at 64 tools): a hit's largest fixed cost after the render (issue 30)."""
    if _plain_boundary(data):
        return data.get("model"), data.get("return_prompt_ids", False)
    req = BoundaryRequest.model_validate(data)
    return req.model, req.return_prompt_ids


def _plain_boundary(data: dict[str, Any]) -> bool:
    """Whether ``BoundaryRequest`` certainly accepts ``data`` (see ``_plain_chat``)."""
    return _plain_chat(data) and type(data.get("return_prompt_ids", False)) is bool


def _plain_chat(data: dict[str, Any]) -> bool:
    """Whether ``ChatRequest`` certainly accepts ``data`` (a JSON object, so every key is a
    str): only exact types, no coercion to ask pydantic about."""
    get = data.get
    messages, tools, kwargs = get("messages"), get("tools"), get("chat_template_kwargs")
    return (type(messages) is list and bool(messages)
            and all(type(m) is dict for m in messages)
            and (tools is None or (type(tools) is list and all(type(t) is dict for t in tools)))
            and (kwargs is None or type(kwargs) is dict)
            and type(get("model")) in (str, type(None))
            and type(get("stream")) in (bool, type(None)))


class PurgeRequest(BaseModel):
    """``POST /admin/purge``: a tenant, a model, or both (at least one)."""

    model_config = ConfigDict(extra="forbid")

    tenant: StrictStr | None = None
    model: StrictStr | None = None


# -- what the OpenAPI document says (``openapi_docs``) ------------------------------------------
# The routes read bodies by hand (exact integers, no copy); these models describe the same
# contract for /openapi.json: the request fields above, typed in full, and every response.

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(BaseModel):
    """A content part: ``{"type": "text", "text": ...}``, an image, audio ... (any object with
    a type; parts other than text render as the template's placeholder)."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: StrictStr | None = None
    type: StrictStr | None = None
    function: dict[str, Any] | None = None


class ChatMessage(BaseModel):
    """A chat message; the leading run of system/developer messages is the static prefix."""

    model_config = ConfigDict(extra="allow")

    role: Role
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """A tool as the chat templates render it (OpenAI's function-tool shape)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(ChatRequest):
    """``POST /v1/chat/completions``: an OpenAI chat body. Fields not listed pass through to
    the upstream unchanged."""

    # The same fields, typed in full for the document (the route checks them as plain dicts).
    messages: list[ChatMessage] = Field(min_length=1)  # type: ignore[assignment]
    tools: list[Tool] | None = None  # type: ignore[assignment]


class PrefixBoundaryRequest(ChatCompletionRequest):
    """``POST /v1/prefix/boundary``: a chat body, optionally asking for the prompt ids, or
    giving them."""

    return_prompt_ids: StrictBool = False
    prompt_ids: list[int] | None = Field(
        default=None, description="the prompt's token ids as the engine has them: the boundary "
        "is cut against these, and the prompt is not rendered (integers in [0, 2**32))")


class BoundaryResponse(BaseModel):
    specprefill_system_end: int = Field(ge=0, description="token index where the static "
                                        "system/tool prefix ends")
    prompt_tokens: int = Field(ge=0)
    cache: Literal["hit", "miss", "none"]
    key: str = Field(description="<prefix>:<tenant>:<model>:<hash>; empty when cache is none")
    prompt_ids: list[int] | None = Field(default=None, description="with return_prompt_ids")


class ChatCompletion(BaseModel):
    """A ``chat.completion`` (the upstream's, relayed as it is, or the in-process engine's)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    object: str | None = None
    created: int | None = None
    model: str | None = None
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every error (an upstream's own error keeps its fields)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape: every error under ``/v1/messages``."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class CountTokensRequest(MessagesConversation):
    """``POST /v1/messages/count_tokens``: a Messages conversation and the model it is for."""

    model: StrictStr | None = None


class HealthStatus(BaseModel):
    status: Literal["ok"]


class ReadyReport(BaseModel):
    """The status for anyone; the details with a metrics or admin key (or on an unlocked
    service)."""

    status: Literal["ready", "not_ready"]
    store: dict[str, Any] | None = None
    upstreams: dict[str, dict[str, Any]] | None = None
    engines: dict[str, dict[str, Any]] | None = None


class PurgeResponse(BaseModel):
    purged: int = Field(ge=0)
    pattern: str


class AdminStats(BaseModel):
    cache: dict[str, Any]
    store: dict[str, Any]
    tenants: list[str]
    models: list[str]
    usage: list[dict[str, Any]] = Field(
        default_factory=list, description="per tenant, of the API requests answered (every "
        "worker's): requests, prompt_tokens, cached_tokens, generated_tokens (for billing)")


class DashboardHistory(BaseModel):
    """The dashboard's history: every worker's, one point per interval."""

    model_config = ConfigDict(extra="allow")

    interval_s: int
    series: dict[str, list[list[float | None]]] = Field(description="name -> [[unix_time, "
                                                        "value], ...]: hit_rate, requests_per_s"
                                                        ", ttft_p50_hit_s, ttft_p50_miss_s, "
                                                        "prompt_tokens_reused_per_s, "
                                                        "prompt_tokens_computed_per_s, ...; "
                                                        "per tenant (tenant:NAME:...) and per "
                                                        "model (model:NAME:...) too")


class DashboardStats(BaseModel):
    """What the dashboard page draws."""

    model_config = ConfigDict(extra="allow")

    metrics: dict[str, Any]
    store_backend: str
    store_health: dict[str, Any]
    models: list[str]
    engines: list[dict[str, Any]]
    upstream_replicas: list[dict[str, Any]] = Field(
        default_factory=list, description="per upstream replica: requests by routing choice, "
        "in flight, ejected, ejections, retries")

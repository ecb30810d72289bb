"""``serve-engine`` as the API layer's host: one model (the engine), one optional API key, the
prompt ids and boundary a sidecar sent (or the conversation rendered here, its boundary cut by
a ``StaticPrefixCache`` of this server's own), and the namespace named in the body when the
server trusts its callers with it.

Why the boundary when rendering: the engine parks a request whose static prefix another one is
prefilling (``mlx_engine/reuse.py``) only when it knows where that prefix ends. Without it, a
burst of chats sharing a system prompt and tools (an agent platform's first minute after a
deploy) computed the prefix once per request: eight of them, 11-13k prompt tokens, 0 reused.

Trust model. The engine keeps the KV of static prefixes per namespace, and a restored prefix
shows in time to first token, so whoever picks the namespace can probe what else was sent in
it. By default the server trusts no caller with that: ``specprefill_namespace`` is ignored and
every request is in namespace "default" -- right for a single-tenant engine, wrong behind a
multi-tenant sidecar (its tenants would share KV; the server logs a warning the first time the
field arrives and is ignored). ``--trust-namespace`` reads the field: use it only when the
callers that can reach the port are trusted to name tenants, i.e. the sidecar alone (bind to
loopback or a private network, and give ``--api-key`` to both: the sidecar's
``upstream_api_key`` is sent as ``Authorization: Bearer``). The sidecar derives the namespace
from its own API keys, never from the client's body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from prefix_cache.api.engine_target import EngineTarget
from prefix_cache.api.host import PreparedPrompt
from prefix_cache.cache.cache import StaticPrefixCache
from prefix_cache.cache.keys import validate_label
from prefix_cache.cache.messages import validate_kwargs, validate_messages, validate_tools
from prefix_cache.chat.conversation import Conversation, for_template
from prefix_cache.chat.responses_store import DEFAULT_BYTES_PER_TENANT, MemoryResponses
from prefix_cache.engine import protocol as wire
from prefix_cache.errors import InvalidRequestError
from prefix_cache.http.auth import bearer_matches, client_authorization, key_hint
from prefix_cache.http.body import JSONBody, read_json_object
from prefix_cache.http.errors import BadRequest, Unauthorized
from prefix_cache.render.render import RenderOptions, get_renderer
from prefix_cache.util.token_ids import TokenIds, checked_token_ids, json_token_ids

from .backend import MLXBackend
from .mlx_engine.request import PROMPT_IDS_CODE

log = logging.getLogger("engine_adapter.server")

DEFAULT_NAMESPACE = "default"
MAX_BODY_BYTES = 32 << 20  # prompt_token_ids of a long prompt are larger than its text


@dataclass(frozen=True, slots=True)
class EngineModel:
    """The one model served: a request's ``model`` is not checked."""

    name: str
    target: EngineTarget


def prompt_ids_of(body: Mapping[str, Any]) -> TokenIds | None:
    """``prompt_token_ids`` as token ids (integers in [0, 2**32), packed once here), or None
    when the body has none; the engine's check holds them against the model."""
    value = body.get(wire.PROMPT_TOKEN_IDS)
    if value is None:
        return None
    try:
        return checked_token_ids(json_token_ids(value, wire.PROMPT_TOKEN_IDS),
                                 wire.PROMPT_TOKEN_IDS)
    except InvalidRequestError as exc:  # the same check, named for this field
        raise InvalidRequestError(str(exc), code=PROMPT_IDS_CODE) from None


def boundary_of(body: Mapping[str, Any], n_ids: int) -> int:
    """``specprefill_system_end`` checked against the prompt's length (default 0)."""
    end = body.get(wire.SPECPREFILL_SYSTEM_END, 0)
    if end is None:
        return 0
    if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= n_ids:
        raise BadRequest(f"{wire.SPECPREFILL_SYSTEM_END} must be an integer in [0, {n_ids}] "
                         f"(the prompt's token count), got {end!r}",
                         code="invalid_specprefill_system_end")
    return end


def render_conversation(tokenizer: Any, c: Conversation) -> list[int]:
    """The prompt ids of a conversation, rendered as the sidecar renders them (transformers'
    convention, with its tools, template kwargs and request-level render fields)."""
    c = for_template(c, tokenizer)
    messages = validate_messages(c.messages)
    tools = validate_tools(c.tools)
    kwargs = validate_kwargs(c.chat_template_kwargs)
    options = RenderOptions(c.add_generation_prompt, c.continue_final_message)
    return get_renderer(tokenizer, c.chat_template, tools).render_ids(messages, tools, kwargs,
                                                                      options)


class Namespaces:
    """Where a request's KV namespace comes from (see the module docstring)."""

    def __init__(self, trust: bool) -> None:
        self.trust = trust
        self._warned = False

    def of(self, fields: Mapping[str, Any]) -> str:
        value = fields.get(wire.SPECPREFILL_NAMESPACE)
        if value is None:
            return DEFAULT_NAMESPACE
        if not self.trust:
            if not self._warned:
                self._warned = True
                log.warning("a request named specprefill_namespace but this server does not "
                            "trust it (no --trust-namespace): everything shares namespace "
                            "'default', so tenants of a sidecar in front share the engine's KV")
            return DEFAULT_NAMESPACE
        try:
            return validate_label(value, wire.SPECPREFILL_NAMESPACE)
        except ValueError as exc:
            raise BadRequest(str(exc), code="invalid_specprefill_namespace") from None

    def purged(self, value: Any) -> str | None:
        """The namespace a purge of ``value`` (a tenant; None: all) must clear. Untrusted, every
        tenant's requests ran in "default", so a tenant's purge clears "default" itself."""
        if value is None:
            return None
        if not isinstance(value, str):
            raise BadRequest(f"{wire.PURGE_NAMESPACE} must be a string or null, got "
                             f"{type(value).__name__}", code="invalid_namespace")
        if not self.trust:
            return DEFAULT_NAMESPACE
        try:
            return validate_label(value, wire.PURGE_NAMESPACE)
        except ValueError as exc:
            raise BadRequest(str(exc), code="invalid_namespace") from None


class EngineHost:
    """See the module docstring."""

    def __init__(self, chat: MLXBackend, *, trust_namespace: bool = False,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 responses_store_bytes: int = DEFAULT_BYTES_PER_TENANT,
                 strict_hosted_tools: bool = False) -> None:
        self.chat = chat
        self.strict_hosted_tools = strict_hosted_tools
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.namespaces = Namespaces(trust_namespace)
        self.responses = MemoryResponses(responses_store_bytes)
        self.boundaries = StaticPrefixCache()   # in memory: this server's renders only
        self.started_at = int(time.time())
        self._model = EngineModel(chat.name, EngineTarget(chat))

    def served(self) -> Iterable[EngineModel]:
        return (self._model,)

    def model(self, name: str | None) -> EngineModel:
        return self._model

    def caller(self, request: Request) -> str:
        if self.api_key:
            given = client_authorization(request.headers.get("authorization"),
                                         request.headers.get("x-api-key"))
            if not bearer_matches(given, self.api_key):
                raise Unauthorized("missing or wrong API key: send it as "
                                   f"{key_hint(request.url.path)}")
        return DEFAULT_NAMESPACE

    def namespace(self, tenant: str, fields: Mapping[str, Any]) -> str:
        return self.namespaces.of(fields)

    def slot(self, tenant: str) -> AbstractAsyncContextManager[None]:
        return nullcontext()

    async def read_body(self, request: Request, tenant: str) -> JSONBody:
        return await read_json_object(request, self.max_body_bytes)

    async def prepare(self, model: EngineModel, tenant: str, conversation: Conversation,
                      body: JSONBody) -> PreparedPrompt:
        """The ids and boundary a sidecar sent (ids without a boundary: 0, nothing reused as
        a static prefix); or the conversation rendered off the event loop with its boundary
        (``boundary``), unless the body names one."""
        ids = prompt_ids_of(body.data)
        if ids is not None:
            return PreparedPrompt(ids, boundary_of(body.data, len(ids)))
        if body.data.get(wire.SPECPREFILL_SYSTEM_END) is None:
            prepared = await self.boundary(conversation, self.namespaces.of(body.data))
            if prepared is not None:
                return prepared
        ids = TokenIds.of_rendered(await asyncio.to_thread(
            render_conversation, self.chat.tokenizer, conversation))
        return PreparedPrompt(ids, boundary_of(body.data, len(ids)))

    async def boundary(self, c: Conversation, namespace: str) -> PreparedPrompt | None:
        """The conversation rendered with its static prefix's end (system and tools), as the
        sidecar cuts it; None when the cache cannot (logged: rendered here, boundary 0). Bad
        input is the 400 the render would give."""
        c = for_template(c, self.chat.tokenizer)
        try:
            result = await self.boundaries.aresolve(
                self.chat.tokenizer, validate_messages(c.messages), validate_tools(c.tools),
                validate_kwargs(c.chat_template_kwargs), namespace=namespace,
                model=self.chat.name, chat_template=c.chat_template,
                add_generation_prompt=c.add_generation_prompt,
                continue_final_message=c.continue_final_message)
        except InvalidRequestError:
            raise
        except Exception as exc:  # never fails the request: no static prefix reused
            log.warning("static prefix boundary not computed, none reused: %s", exc)
            return None
        return PreparedPrompt(result.prompt, result.specprefill_system_end)

    def close(self) -> None:
        self.boundaries.close()

    def headers(self, prompt: PreparedPrompt) -> dict[str, str]:
        return {}

    async def purge(self, request: Request) -> dict[str, Any]:
        """``POST /admin/purge``: a namespace's KV (RAM and disk) and stored responses go, or
        everyone's; the caller needs the server's API key, as for every call."""
        self.caller(request)
        body = (await read_json_object(request, self.max_body_bytes)).data
        namespace = self.namespaces.purged(body.get(wire.PURGE_NAMESPACE))
        kv = await asyncio.to_thread(self.chat.purge_kv, namespace)
        responses = await self.responses.purge(namespace)
        log.info("purged namespace %s: %d KV entries, %d stored responses",
                 "(all)" if namespace is None else namespace, kv, responses)
        return {"purged": kv, "responses": responses, "namespace": namespace}

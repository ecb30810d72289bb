"""The sidecar as the API layer's host: callers by API key, each tenant its own namespace and
share of the worker, and every conversation's boundary resolved in the static-prefix cache."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ..api.engine_target import EngineTarget
from ..api.host import PreparedPrompt, Target
from ..cache.cache import PrefixResult
from ..chat.conversation import Conversation, for_template
from ..chat.responses_store import ResponseStore
from ..util.hints import Hints
from ..http.auth import client_authorization, key_hint
from ..http.body import JSONBody, PartMemo, read_json_object
from .proxy_target import ProxyTarget
from .served_models import ServedModel
from .settings import env_name
from .state import ServiceState

MAX_BODY_SETTING = env_name("max_body_bytes")  # named in a 413


@dataclass(frozen=True, slots=True)
class Routed:
    """A configured model and what answers its turns."""

    model: ServedModel
    target: Target

    @property
    def name(self) -> str:
        return self.model.name


def cache_headers(result: PrefixResult | PreparedPrompt) -> dict[str, str]:
    return {"x-prefix-cache": result.cache,
            "x-specprefill-system-end": str(result.specprefill_system_end)}


class SidecarHost:
    """See the module docstring; one per app (worker)."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.started_at = state.started_at
        self.strict_hosted_tools = state.settings.strict_hosted_tools
        self._routed = {m.name: Routed(m, self._target(m)) for m in state.models}
        # The exact bytes of large body parts each tenant sent before (its own, invariant 5).
        self.parts = PartMemo()

    def _target(self, model: ServedModel) -> Target:
        if model.engine is not None:
            return EngineTarget(model.engine)
        return ProxyTarget(model, lambda: self.state.http)

    @property
    def responses(self) -> ResponseStore:
        return self.state.responses

    def served(self) -> Iterable[Routed]:
        return self._routed.values()

    def model(self, name: str | None) -> Routed:
        return self._routed[self.state.models.get(name).name]  # NotFound for an unknown name

    def caller(self, request: Request) -> str:
        headers = request.headers  # (scope["path"]: request.url builds a whole URL object)
        return self.state.keyring.tenant_for(
            client_authorization(headers.get("authorization"), headers.get("x-api-key")),
            key_hint(request.scope["path"]))

    def namespace(self, tenant: str, fields: Mapping[str, Any]) -> str:
        return tenant  # from the caller's key, never from what it sends (invariant 5)

    def slot(self, tenant: str) -> AbstractAsyncContextManager[None]:
        return self.state.limits.slot(tenant)

    async def read_body(self, request: Request, tenant: str, share: bool = False) -> JSONBody:
        """``share``: the caller changes nothing in the body (``fastpath.parse_body``)."""
        return await read_json_object(request, self.state.settings.max_body_bytes,
                                      MAX_BODY_SETTING, self.parts, tenant, share)

    async def prepare(self, model: Routed, tenant: str, conversation: Conversation,
                      body: JSONBody) -> PreparedPrompt:
        """The conversation's boundary (of any API) in the tenant's namespace, within the
        tenant's prompt size limit."""
        result = await self.resolve(model.model, tenant, conversation, len(body.raw),
                                    hints=body.hints)
        await self.state.limits.spend_tokens(tenant, result.prompt_tokens)
        return PreparedPrompt.of(result)

    async def resolve(self, model: ServedModel, tenant: str, conversation: Conversation,
                      body_size: int, prompt_ids: Any = None,
                      hints: Hints | None = None) -> PrefixResult:
        """``prompt_ids``: the client's own (checked by the cache: a 400 unless token ids);
        ``hints``: what the body's parse already worked out."""
        c, state = for_template(conversation, model.tokenizer), self.state
        state.limits.check_prompt(tenant, body_size, c.messages, c.tools, c.chat_template_kwargs)
        return await state.cache.aresolve(
            model.tokenizer, c.messages, c.tools, c.chat_template_kwargs, namespace=tenant,
            model=model.label, chat_template=c.chat_template,
            add_generation_prompt=c.add_generation_prompt,
            continue_final_message=c.continue_final_message, prompt_ids=prompt_ids,
            hints=hints)

    def headers(self, prompt: PreparedPrompt) -> dict[str, str]:
        return cache_headers(prompt)

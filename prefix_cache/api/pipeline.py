"""The one way from a body to an answer, for every API (chat completions, Messages,
Responses), on both servers:

    body ── the API's parser ──> AgentCall (one typed call: conversation, sampling, stream)
         ── target.check ──> refused here, before anything is resolved (nothing cached)
         ── host.prepare ──> prompt ids and boundary (the sidecar's cache, or the engine's ids)
         ── target.generate(Turn) ──> in-process engine events, or an upstream's answer
         ── the API's encoder (JSON or SSE), or the upstream's bytes relayed
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ..chat.agent_call import AgentCall
from ..chat.events import Finish, OutputEvent, Prefilled
from ..http.body import JSONBody
from ..http.request_record import current_record
from .host import Api, Host, PreparedPrompt, ServedModel
from .schemas import check_chat_body


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request whose caller, body and namespace are known."""

    tenant: str
    namespace: str
    json: JSONBody

    @property
    def raw(self) -> bytes:
        return self.json.raw

    @property
    def body(self) -> dict[str, Any]:
        return self.json.data


async def admit(request: Request, host: Host, tenant: str, api: Api) -> Admitted:
    """The body read (size limit) and checked, and the caller's namespace. The check is the
    same whichever host mounts the routes, so a bad body gets the same 400 from both servers
    (a chat body's field types here; every API's fields in its parser)."""
    record = current_record()
    if record is not None:
        record.tenant = tenant
    body = await host.read_body(request, tenant)
    if api == "chat":
        check_chat_body(body.data)
    return Admitted(tenant, host.namespace(tenant, body.data), body)


async def prepare(host: Host, api: Api, model: ServedModel, call: AgentCall,
                  admitted: Admitted) -> PreparedPrompt:
    """The call's prompt ids and boundary, once its model's target can run it (a refused
    request caches nothing)."""
    record = current_record()
    if record is not None:
        record.model = model.name
    model.target.check(call, api)
    prompt = await host.prepare(model, admitted.tenant, call.conversation, admitted.json)
    if record is not None:
        record.cache, record.prompt_tokens = prompt.cache, prompt.prompt_tokens
    return prompt


async def recorded(events: AsyncGenerator[OutputEvent, None]
                   ) -> AsyncGenerator[OutputEvent, None]:
    """A turn's events as they are, noting in the request's record when its content starts
    and the usage it finished with (the in-process engine's, or an upstream's converted)."""
    record = current_record()
    async with aclosing(events):
        async for event in events:
            if record is not None:
                if isinstance(event, Finish | Prefilled):
                    u = event.usage
                    record.usage(u.prompt_tokens or None, u.cached_tokens,
                                 u.completion_tokens if isinstance(event, Finish) else None)
                else:
                    record.content_started()
            yield event


def model_name(body: Mapping[str, Any]) -> str | None:
    """The ``model`` a body names (None: the host's default)."""
    name = body.get("model")
    return name if isinstance(name, str) else None

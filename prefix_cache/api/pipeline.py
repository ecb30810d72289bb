"""The one way from a body to an answer, for every API (chat completions, Messages,
Responses), on both servers:

    body ── checked (the same on both servers) ──> the API's parser ──> AgentCall (one typed
            call: conversation, sampling, stream)
         ── target.check ──> refused here, before anything is resolved (nothing cached)
         ── host.prepare ──> PreparedPrompt (the sidecar's cache, or the engine's ids)
         ── target.generate(Turn, Relay) ──> in-process engine events, or an upstream's answer
         ── run: the events recorded, or the upstream's bytes relayed as they come
         ── the route encodes the events in its API (JSON or SSE)

One way: no step calls back into an earlier one (a target never answers for the route).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from ..chat.agent_call import AgentCall
from ..chat.events import Events, Finish, OutputEvent, Prefilled
from ..chat.hosted_tools import left_out
from ..http.body import JSONBody
from ..http.relay import RelayResponse, RelayTap
from ..http.request_record import current_record
from ..http.usage_tap import UsageTap
from .host import Api, Host, PreparedPrompt, Relay, Relayed, ServedModel, Turn
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
        record.cache, record.prompt_tokens = prompt.cache, len(prompt.ids)
    return prompt


async def run(model: ServedModel, turn: Turn, relay: Relay,
              headers: dict[str, str]) -> Events | Response:
    """The turn run on its model's target: its events (noted in the request's record) for
    the route to encode, or the upstream's answer relayed with the host's ``headers``."""
    record = current_record()
    if record is not None:
        record.dispatch()
    outcome = await model.target.generate(turn, relay)
    if isinstance(outcome, Relayed):
        response = outcome.response
        return RelayResponse(response, headers, _tap(response, relay.tap), relay.error_event)
    return recorded(outcome)


def _tap(response: httpx.Response, inner: RelayTap | None) -> RelayTap | None:
    """The relay's own tap, behind one that notes the relayed answer's TTFT and usage."""
    record = current_record()
    if record is None:
        return inner
    streamed = response.headers.get("content-type", "").startswith("text/event-stream")
    return UsageTap(record, streamed, inner)


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
                    if isinstance(event, Finish):
                        record.finish_reason = event.reason
                    else:
                        record.prefill_done()
                else:  # generated content, streamed or not: TTFT is the first token's
                    record.content()
            yield event


def hosted_left_out(host: Host, model: ServedModel, call: AgentCall, api: Api
                    ) -> dict[str, str]:
    """The header naming the hosted tools left out of the prompt (a 400 under
    ``strict_hosted_tools``); none where the body goes to an upstream serving the API, which
    runs them."""
    if model.target.relays(api):
        return {}
    return left_out(call.hosted_tools, host.strict_hosted_tools, model.name)


def model_name(body: Mapping[str, Any]) -> str | None:
    """The ``model`` a body names (None: the host's default)."""
    name = body.get("model")
    return name if isinstance(name, str) else None

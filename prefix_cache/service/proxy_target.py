"""An upstream as a model's target: the sidecar's proxy.

A turn goes to one replica of the model's pool (routed by the tenant's static prefix and the
client's session id where it names one, so its turns go where its KV is: ``pool.py``,
``session_hint.py``):

- an API the upstream serves itself (chat completions always; ``upstream_apis``): the body as it
  came (plus the boundary fields for ``specprefill`` upstreams), its answer relayed as it comes;
- an API it does not serve: the call as a chat completion, its answer (JSON or SSE) converted
  back to the API's shape (``chat.openai_decode``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx

from ..api.host import Api, Relay, Relayed, Turn
from ..chat.agent_call import AgentCall
from ..chat.events import Events
from ..chat.openai_decode import completion_events
from ..http.errors import ClientDisconnected
from ..http.relay import until_disconnect
from ..util import json_io
from .served_models import ServedModel
from .session_hint import session_hint


@dataclass(frozen=True, slots=True)
class ProxyTarget:
    model: ServedModel
    client: Callable[[], httpx.AsyncClient]  # the worker's upstream client, once it is open

    def relays(self, api: Api) -> bool:
        return self.model.upstream is not None and self.model.upstream.speaks(api)

    def check(self, call: AgentCall, api: Api) -> None:
        if not self.model.require_upstream().speaks(api):  # a model with no upstream: a 400
            call.check_chat_support()

    async def generate(self, turn: Turn, relay: Relay) -> Events | Relayed:
        upstream, prompt = self.model.require_upstream(), turn.prompt
        if upstream.speaks(turn.api):
            content = upstream.forward_content(relay.raw, relay.body, prompt,
                                               namespace=turn.namespace,
                                               with_prompt_ids=relay.with_prompt_ids,
                                               api=turn.api)
            return Relayed(await self._open(turn, relay, turn.api, content))
        chat = turn.call.chat_body(turn.call.model or self.model.name)
        content = upstream.forward_content(json_io.dumps(chat), chat, prompt,
                                           namespace=turn.namespace)
        response = await self._open(turn, relay, "chat", content)
        return completion_events(response, stream=turn.call.stream,
                                 prompt_tokens=len(prompt.ids))

    async def _open(self, turn: Turn, relay: Relay, api: str, content: bytes
                    ) -> httpx.Response:
        session = session_hint(relay.body, turn.request.headers)
        opened = self.model.require_pool().open(self.client(), content, api,
                                                tenant=turn.namespace, key=turn.prompt.key,
                                                session=session)
        response, disconnected = await until_disconnect(turn.request.receive, opened)
        if disconnected or response is None:
            raise ClientDisconnected("the client disconnected before the upstream answered")
        return response


"""What the shared API layer asks of the server that mounts it: the one seam between the routes
(the same for ``prefix-cache serve`` and ``prefix-cache serve-engine``) and what differs.

    Host      who the caller is (keys), their namespace, their share of the worker, the body
              size limit, the served models, the stored responses, and how a conversation
              becomes prompt ids and a boundary: the sidecar resolves it in its cache
              (``service.sidecar_host``); the engine server takes the ids and boundary a
              sidecar sent, or renders (``engine_adapter.engine_host``)
    Target    what answers a model's turn: the in-process engine (``api.engine_target``), or
              an upstream behind a proxy (``service.proxy_target``)
    PreparedPrompt  what a host's ``prepare`` hands a target: the prompt's ids and the static
              prefix's end in them, and where a cache produced them, its verdict and key
    Turn      one request on its way to a target: the API's typed call, its prepared prompt,
              the namespace, and how the API answers a turn's events
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fastapi import Request
from fastapi.responses import Response

from ..cache import HIT, NONE, PrefixResult
from ..chat.agent_call import AgentCall
from ..chat.conversation import Conversation
from ..chat.events import Events
from ..chat.responses_store import ResponseStore
from ..http.body import JSONBody
from ..http.relay import RelayTap
from ..token_ids import TokenIds

Api = Literal["chat", "messages", "responses"]
# Answers a turn's events in the API's shape: (events, prompt tokens, headers) -> response.
Answer = Callable[[Events, int, dict[str, str]], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A conversation made ready for a target: its prompt's ids (checked, packed), the static
    prefix's end in them, and where a cache produced them its verdict and key (else "none"
    and "": ``serve-engine`` takes the ids and boundary a sidecar sent, or renders)."""

    ids: TokenIds
    specprefill_system_end: int
    cache: str = NONE
    key: str = ""

    @classmethod
    def of(cls, result: PrefixResult) -> PreparedPrompt:
        """What the static-prefix cache answered, as a target reads it."""
        return cls(result.prompt, result.specprefill_system_end, result.cache, result.key)

    @property
    def hit(self) -> bool:
        return self.cache == HIT

    @property
    def prompt_ids(self) -> list[int]:
        return self.ids.ids

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class Turn:
    """One request, checked and resolved, on its way to its model's target."""

    api: Api
    request: Request           # the client's (its disconnect cancels the turn)
    raw: bytes                 # the body as sent, and parsed
    body: dict[str, Any]
    call: AgentCall
    prompt: PreparedPrompt     # the prompt ids and the boundary
    namespace: str             # the tenant whose engine KV the turn may reuse
    headers: dict[str, str]    # the host's headers of the answer (x-prefix-cache ...)
    answer: Answer
    tap: RelayTap | None = None                         # sees a relayed answer go by
    error_event: Callable[[str], bytes] | None = None   # ends a relayed stream that breaks
    with_prompt_ids: bool = True  # False: the upstream renders more than the ids cut here


class Target(Protocol):
    """What answers a model's turns."""

    def relays(self, api: Api) -> bool:
        """Whether a body of ``api`` goes to the target as it came (it answers in that API)."""
        ...

    def check(self, call: AgentCall, api: Api) -> None:
        """A 4xx before anything is resolved when the target cannot run ``call`` as asked."""
        ...

    async def generate(self, turn: Turn) -> Response: ...


class ServedModel(Protocol):
    """A model as the routes see it."""

    @property
    def name(self) -> str: ...

    @property
    def target(self) -> Target: ...


class Host(Protocol):
    """The server under the shared routes (see the module docstring)."""

    started_at: int

    @property
    def responses(self) -> ResponseStore: ...

    def served(self) -> Iterable[ServedModel]:
        """The models ``GET /v1/models`` lists."""
        ...

    def model(self, name: str | None) -> ServedModel:
        """The model a request names (None: the default); NotFound otherwise."""
        ...

    def caller(self, request: Request) -> str:
        """The caller's tenant from its key; Unauthorized/Forbidden otherwise."""
        ...

    def namespace(self, tenant: str, fields: Mapping[str, Any]) -> str:
        """The namespace of the caller's data (stored responses, engine KV); ``fields``: the
        body, or a body-less request's query."""
        ...

    def slot(self, tenant: str) -> AbstractAsyncContextManager[None]:
        """The tenant's share of this worker, held while its request is prepared."""
        ...

    async def read_body(self, request: Request, tenant: str) -> JSONBody:
        """The caller's JSON body, within the size limit."""
        ...

    async def prepare(self, model: ServedModel, tenant: str, conversation: Conversation,
                      body: JSONBody) -> PreparedPrompt:
        """The conversation's prompt ids and boundary (renders off the event loop)."""
        ...

    def headers(self, prompt: PreparedPrompt) -> dict[str, str]:
        """The headers every answer of a prepared request carries."""
        ...

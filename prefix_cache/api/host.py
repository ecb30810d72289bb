"""What the shared API layer asks of the server that mounts it: the one seam between the routes
(the same for ``prefix-cache serve`` and ``prefix-cache serve-engine``) and what differs.

    Host      who the caller is (keys), their namespace, their share of the worker, the body
              size limit, the served models, the stored responses, and how a conversation
              becomes prompt ids and a boundary: the sidecar resolves it in its cache
              (``service.sidecar_host``); the engine server takes the ids and boundary a
              sidecar sent, or renders (``engine_adapter.engine_host``)
    Target    what runs a model's turn: the in-process engine (``api.engine_target``), or
              an upstream behind a proxy (``service.proxy_target``); it returns the turn's
              events, or an upstream's answer in the turn's API to relay (``Relayed``), and
              never calls back into the route: the route encodes (one way, ``api.pipeline``)
    PreparedPrompt  what a host's ``prepare`` hands a target: the prompt's ids and the static
              prefix's end in them, and where a cache produced them, its verdict and key
    Turn      what every target reads of a request: the API's typed call, its prepared
              prompt, the namespace, the client's connection
    Relay     what only a relay reads: the body as sent, and how its relayed answer is watched
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx
from fastapi import Request

from ..cache.cache import NONE, PrefixResult
from ..chat.agent_call import AgentCall
from ..chat.conversation import Conversation
from ..chat.events import Events
from ..chat.responses_store import ResponseStore
from ..http.body import JSONBody
from ..http.relay import RelayTap
from ..util.token_ids import TokenIds

Api = Literal["chat", "messages", "responses"]


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


@dataclass(frozen=True, slots=True)
class Turn:
    """One request, checked and prepared: what every target reads."""

    api: Api
    call: AgentCall
    prompt: PreparedPrompt     # the prompt ids and the boundary
    namespace: str             # the tenant whose engine KV the turn may reuse
    request: Request           # the client's (its disconnect cancels the turn)


@dataclass(frozen=True, slots=True)
class Relay:
    """What only a relay reads: the body as the client sent it (and parsed), and how an
    upstream's answer in the turn's own API is watched as it is passed on."""

    raw: bytes
    body: dict[str, Any]
    tap: RelayTap | None = None                         # sees a relayed answer go by
    error_event: Callable[[str], bytes] | None = None   # ends a relayed stream that breaks
    with_prompt_ids: bool = True  # False: the upstream renders more than the ids cut here


@dataclass(frozen=True, slots=True)
class Relayed:
    """An upstream's answer in the turn's own API, open (2xx), to pass on as it comes."""

    response: httpx.Response


class Target(Protocol):
    """What runs a model's turns."""

    def relays(self, api: Api) -> bool:
        """Whether a body of ``api`` goes to the target as it came (it answers in that API)."""
        ...

    def check(self, call: AgentCall, api: Api) -> None:
        """A 4xx before anything is resolved when the target cannot run ``call`` as asked."""
        ...

    async def generate(self, turn: Turn, relay: Relay) -> Events | Relayed:
        """The turn's events, or an upstream's answer to relay; a 4xx before anything runs
        when the engine refuses the request."""
        ...


class ServedModel(Protocol):
    """A model as the routes see it."""

    @property
    def name(self) -> str: ...

    @property
    def target(self) -> Target: ...


class Host(Protocol):
    """The server under the shared routes (see the module docstring)."""

    started_at: int
    # Refuse a request with hosted tools the target cannot run, rather than leave them out.
    strict_hosted_tools: bool

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

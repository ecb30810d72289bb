"""Upstreams: the OpenAI-compatible servers requests are forwarded to, by kind.

Chat completions go to every upstream. The agent APIs (Anthropic ``messages``, OpenAI
``responses``) go as they are to an upstream that serves them (``apis``: by default our own
engine's server, kind ``specprefill``, which serves both); to any other the sidecar sends the
conversation as a chat completion and converts the answer back.

What is attached to the forwarded body depends on the upstream's kind:

- ``openai``: nothing. Plain OpenAI-compatible servers would reject or silently drop extension
  fields (mlx_lm.server drops them), so the client's bytes go out unchanged -- unless
  ``upstream_model`` renames the model, the one field then rewritten.

Whatever the kind, the fields the sidecar owns (``engine.protocol.is_owned_field``: the
boundary, the prompt ids, the namespace, any other ``specprefill*`` name but the client's
SpecPrefill knobs) are removed from a client's body first: a client never names a tenant.
- ``specprefill``: our engines, which take the boundary instead of recomputing it: the body
  gains ``specprefill_system_end``, ``prompt_token_ids`` (the ids the boundary was cut
  against, so the engine prefills exactly the prompt the boundary belongs to) and
  ``specprefill_namespace`` (the tenant, so the engine keeps each tenant's static-prefix KV
  apart: ``prefix-cache serve-engine --trust-namespace`` reads it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from ..api.host import PreparedPrompt
from ..engine import protocol as wire
from ..http.errors import (
    UpstreamBadStatus,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from ..http.relay import client_headers, relays_status
from ..http.request_id import HEADER as REQUEST_ID_HEADER
from ..http.request_id import current_request_id
from ..util import json_io
from .settings import UpstreamKind

log = logging.getLogger("prefix_cache.service")

KINDS: tuple[str, ...] = ("openai", "specprefill")
AGENT_APIS: tuple[str, ...] = ("messages", "responses")
API_PATHS = {"chat": "/chat/completions", "messages": "/messages", "responses": "/responses"}
DEFAULT_HEALTH_PATH = "/health"
# Each API's output limit fields (the first is the one a default is written in).
LIMIT_FIELDS = {"chat": ("max_tokens", "max_completion_tokens"),
                "responses": ("max_output_tokens",)}
MAX_RELAYED_ERROR_BYTES = 64 * 1024  # an upstream error body is relayed, never hoarded


def normalize_base_url(url: str) -> str:
    """An OpenAI base URL (``http://host:port/v1``); a bare ``http://host:port`` gets ``/v1``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"upstream URL {url!r} must be http:// or https:// with a host")
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass(frozen=True, slots=True)
class FirstByte:
    """How long an upstream may take to start its answer before its health is checked."""

    seconds: float
    probe_timeout_s: float


@dataclass(frozen=True, slots=True)
class Upstream:
    """One upstream server: where it is, what kind it is, how it is called."""

    base_url: str
    kind: UpstreamKind = "openai"
    model: str | None = None          # the model name sent upstream; None: the client's
    api_key: str | None = None        # the sidecar's own key for the upstream, never the client's
    health_path: str = DEFAULT_HEALTH_PATH
    apis: tuple[str, ...] | None = None  # agent APIs served as they are; None: by kind
    # Output tokens asked for on a request that names no limit (None: the upstream's default;
    # vLLM's runs to the context's end).
    default_max_tokens: int | None = None
    # Each API's URL parsed once: httpx parses a string URL again on every request (~40 us
    # of a relayed hit's CPU, measured in bench/relay_stall.py's profile).
    _parsed_urls: dict[str, httpx.URL] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"upstream kind {self.kind!r} is not one of {', '.join(KINDS)}")
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))
        apis = self.apis
        if apis is None:
            apis = AGENT_APIS if self.kind == "specprefill" else ()
        unknown = [api for api in apis if api not in AGENT_APIS]
        if unknown:
            raise ValueError(f"upstream APIs {unknown} are not among {', '.join(AGENT_APIS)}")
        object.__setattr__(self, "apis", tuple(apis))
        object.__setattr__(self, "_parsed_urls",
                           {api: httpx.URL(self.url(api)) for api in API_PATHS})

    @property
    def chat_url(self) -> str:
        return self.url("chat")

    def url(self, api: str) -> str:
        """Where the upstream serves ``api`` ("chat", "messages", "responses")."""
        return self.base_url + API_PATHS[api]

    def speaks(self, api: str) -> bool:
        """Whether ``api`` goes to this upstream as it is (else as a chat completion)."""
        return api == "chat" or api in (self.apis or ())

    @property
    def health_url(self) -> str:
        parts = urlsplit(self.base_url)
        return urlunsplit((parts.scheme, parts.netloc, self.health_path, "", ""))

    def forward_content(self, raw: bytes, body: Mapping[str, Any], result: PreparedPrompt,
                        namespace: str = "default", with_prompt_ids: bool = True,
                        api: str = "chat") -> bytes:
        """The bytes to send upstream for a client body (``raw`` parsed is ``body``) of a
        request of ``api`` in tenant ``namespace`` (``with_prompt_ids`` False: the upstream
        renders the prompt itself, the ids cut here being not the whole of it)."""
        owned = any(wire.is_owned_field(name) for name in body)
        limit = self._missing_limit(body, api)
        if self.kind == "openai" and self.model is None and not owned and limit is None:
            return raw  # unchanged, byte for byte
        # Whatever the kind: a field the sidecar owns never comes from the client (a plain
        # OpenAI upstream may be one of our engines, trusting the namespace it is sent).
        out = wire.without_owned_fields(body) if owned else dict(body)
        if limit is not None:
            out[limit] = self.default_max_tokens
        if self.model is not None:
            out["model"] = self.model
        if self.kind == "specprefill":
            out[wire.SPECPREFILL_SYSTEM_END] = result.specprefill_system_end
            if with_prompt_ids:
                out[wire.PROMPT_TOKEN_IDS] = result.ids.ids
            out[wire.SPECPREFILL_NAMESPACE] = namespace
        return json_io.dumps(out)

    def _missing_limit(self, body: Mapping[str, Any], api: str) -> str | None:
        """The field that gets ``default_max_tokens``: the API's output limit when the body
        names none (Messages always does) and a default is set; else None."""
        fields = LIMIT_FIELDS.get(api, ())
        if self.default_max_tokens is None or not fields \
                or any(body.get(name) is not None for name in fields):
            return None
        return fields[0]

    def headers(self) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            # Relayed byte for byte: a compressed body would need its encoding kept in step.
            "accept-encoding": "identity",
        }
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        request_id = current_request_id.get()
        if request_id is not None:  # the upstream's logs line up with ours
            headers[REQUEST_ID_HEADER] = request_id
        return headers

    async def open(self, client: httpx.AsyncClient, content: bytes,
                   api: str = "chat", first_byte: FirstByte | None = None) -> httpx.Response:
        """Send a request of ``api``; the response is open (streaming) and 2xx, else raised.
        With ``first_byte``: an answer that has not started within its limit while the
        upstream's health check fails (a stalled process) is an ``UpstreamTimeout``.

        The caller owns the returned response and must close it.
        """
        url = self.url(api)
        request = client.build_request("POST", self._parsed_urls[api], content=content,
                                       headers=self.headers())
        # Clients see what went wrong, not where: upstream addresses stay in the operator's log.
        try:
            sent = client.send(request, stream=True)
            response = await (sent if first_byte is None else
                              self._first_byte(client, sent, first_byte))
        except httpx.TimeoutException as exc:
            log.warning("upstream %s timed out: %r", url, exc)
            raise UpstreamTimeout("the upstream did not answer in time") from exc
        except httpx.HTTPError as exc:
            log.warning("upstream %s failed: %r", url, exc)
            raise UpstreamUnavailable(
                f"the upstream is unreachable ({type(exc).__name__})") from exc
        if not relays_status(response.status_code):
            await response.aclose()
            log.warning("upstream %s answered %d: not relayed", url, response.status_code)
            raise UpstreamBadStatus(
                f"the upstream answered with HTTP status {response.status_code}, which is "
                "not relayed: the sidecar passes on 2xx answers and 4xx/5xx errors only")
        if response.status_code >= 400:
            try:
                body = await _read_capped(response, MAX_RELAYED_ERROR_BYTES)
            finally:
                await response.aclose()
            log.info("upstream %s answered %d%s", url, response.status_code,
                     _their_id(response.headers))
            raise UpstreamStatusError(response.status_code, body,
                                      response.headers.get("content-type"),
                                      client_headers(response.headers, with_body=False))
        return response

    @property
    def purges(self) -> bool:
        """Whether the upstream keeps tenants' KV that an admin purge must reach: our engines."""
        return self.kind == "specprefill"

    @property
    def purge_url(self) -> str:
        parts = urlsplit(self.base_url)
        return urlunsplit((parts.scheme, parts.netloc, wire.PURGE_PATH, "", ""))

    async def purge(self, client: httpx.AsyncClient, namespace: str | None,
                    timeout_s: float) -> str | None:
        """Ask the engine to delete a namespace's KV and responses (None: all); None when it
        did, else why not (for the operator's log)."""
        try:
            response = await client.post(self.purge_url, headers=self.headers(),
                                         content=json_io.dumps({wire.PURGE_NAMESPACE: namespace}),
                                         timeout=timeout_s)
        except httpx.HTTPError as exc:
            return repr(exc)
        if response.status_code != 200:
            return f"answered {response.status_code}: {response.text[:200]}"
        return None

    async def _first_byte(self, client: httpx.AsyncClient, sent: Awaitable[httpx.Response],
                          limit: FirstByte) -> httpx.Response:
        """``sent``'s response, waited for in spans of ``limit.seconds``: after each span
        without an answer the upstream's health is checked, and a failed check gives up (a
        busy upstream answers its health check and keeps the request)."""
        task = asyncio.ensure_future(sent)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=limit.seconds)
                if done:
                    return task.result()
                health = await self.probe(client, limit.probe_timeout_s)
                if not health["ok"] and not task.done():
                    log.warning("upstream %s sent no first byte in %.1f s and failed its "
                                "health check", self.base_url, limit.seconds)
                    raise UpstreamTimeout("the upstream did not start its answer in time")
        finally:
            if not task.done():
                task.cancel()  # closes its connection; its outcome is of no interest now
                task.add_done_callback(_ignore_outcome)

    async def probe(self, client: httpx.AsyncClient, timeout_s: float) -> dict[str, Any]:
        """Readiness: the upstream answers HTTP below 500 at its health path."""
        try:
            response = await client.get(self.health_url, headers=self.headers(),
                                        timeout=timeout_s)
        except httpx.HTTPError as exc:  # the probe is public: the kind of failure, not details
            return {"ok": False, "error": type(exc).__name__}
        return {"ok": response.status_code < 500, "status": response.status_code}


def _ignore_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "never retrieved" warning


def _their_id(headers: httpx.Headers) -> str:
    """The upstream's own request id, for the log line that ties it to ours."""
    theirs = headers.get("request-id") or headers.get(REQUEST_ID_HEADER)
    return f" (its request id {theirs[:128]})" if theirs else ""


async def _read_capped(response: httpx.Response, limit: int) -> bytes:
    """At most ``limit`` bytes of a response body."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in response.aiter_raw():
            chunks.append(chunk[: limit - size])
            size += len(chunks[-1])
            if size >= limit:
                break
    except httpx.HTTPError:
        pass  # what arrived before the failure is still the best message there is
    return b"".join(chunks)

"""Upstreams: the OpenAI-compatible servers requests are forwarded to, by kind.

Chat completions go to every upstream. The agent APIs (Anthropic ``messages``, OpenAI
``responses``) go as they are to an upstream that serves them (``apis``: by default our own
engine's server, kind ``specprefill``, which serves both); to any other the sidecar sends the
conversation as a chat completion and converts the answer back.

What is attached to the forwarded body depends on the upstream's kind:

- ``openai``: nothing. Plain OpenAI-compatible servers would reject or silently drop extension
  fields (mlx_lm.server drops them), so the client's bytes go out unchanged -- unless
  ``upstream_model`` renames the model, the one field then rewritten.
- ``specprefill``: our engines, which take the boundary instead of recomputing it: the body
  gains ``specprefill_system_end``, ``prompt_token_ids`` (the ids the boundary was cut
  against, so the engine prefills exactly the prompt the boundary belongs to) and
  ``specprefill_namespace`` (the tenant, so the engine keeps each tenant's static-prefix KV
  apart: ``prefix-cache serve-engine --trust-namespace`` reads it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from .. import engine_protocol as wire
from .. import json_io
from ..cache import PrefixResult
from ..http.errors import (
    UpstreamBadStatus,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from ..http.relay import client_headers, relays_status
from ..http.request_id import HEADER as REQUEST_ID_HEADER
from ..http.request_id import current_request_id
from .settings import UpstreamKind

log = logging.getLogger("prefix_cache.service")

KINDS: tuple[str, ...] = ("openai", "specprefill")
AGENT_APIS: tuple[str, ...] = ("messages", "responses")
API_PATHS = {"chat": "/chat/completions", "messages": "/messages", "responses": "/responses"}
DEFAULT_HEALTH_PATH = "/health"
MAX_RELAYED_ERROR_BYTES = 64 * 1024  # an upstream error body is relayed, never hoarded


def normalize_base_url(url: str) -> str:
    """An OpenAI base URL (``http://host:port/v1``); a bare ``http://host:port`` gets ``/v1``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"upstream URL {url!r} must be http:// or https:// with a host")
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass(frozen=True, slots=True)
class Upstream:
    """One upstream server: where it is, what kind it is, how it is called."""

    base_url: str
    kind: UpstreamKind = "openai"
    model: str | None = None          # the model name sent upstream; None: the client's
    api_key: str | None = None        # the sidecar's own key for the upstream, never the client's
    health_path: str = DEFAULT_HEALTH_PATH
    apis: tuple[str, ...] | None = None  # agent APIs served as they are; None: by kind

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

    def forward_content(self, raw: bytes, body: Mapping[str, Any], result: PrefixResult,
                        namespace: str = "default", with_prompt_ids: bool = True) -> bytes:
        """The bytes to send upstream for a client body (``raw`` parsed is ``body``) of a
        request in tenant ``namespace`` (``with_prompt_ids`` False: the upstream renders the
        prompt itself, the ids cut here being not the whole of it)."""
        if self.kind == "openai" and self.model is None:
            return raw  # unchanged, byte for byte
        out = dict(body)
        if self.model is not None:
            out["model"] = self.model
        if self.kind == "specprefill":
            out[wire.SPECPREFILL_SYSTEM_END] = result.specprefill_system_end
            if with_prompt_ids:
                out[wire.PROMPT_TOKEN_IDS] = result.prompt_ids
            out[wire.SPECPREFILL_NAMESPACE] = namespace
        return json_io.dumps(out)

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
                   api: str = "chat") -> httpx.Response:
        """Send a request of ``api``; the response is open (streaming) and 2xx, else raised.

        The caller owns the returned response and must close it.
        """
        url = self.url(api)
        request = client.build_request("POST", url, content=content, headers=self.headers())
        # Clients see what went wrong, not where: upstream addresses stay in the operator's log.
        try:
            response = await client.send(request, stream=True)
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

    async def probe(self, client: httpx.AsyncClient, timeout_s: float) -> dict[str, Any]:
        """Readiness: the upstream answers HTTP below 500 at its health path."""
        try:
            response = await client.get(self.health_url, headers=self.headers(),
                                        timeout=timeout_s)
        except httpx.HTTPError as exc:  # the probe is public: the kind of failure, not details
            return {"ok": False, "error": type(exc).__name__}
        return {"ok": response.status_code < 500, "status": response.status_code}


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

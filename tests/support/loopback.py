"""Loopback networking for tests: free ports, and HTTP clients that never use a proxy."""

from __future__ import annotations

import random
import socket
from typing import Any

import httpx


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port; for Redis cluster nodes also its bus port (port + 10000) must be
    free."""
    if not cluster_bus:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def local_client(timeout: float = 30.0, **kwargs: Any) -> httpx.Client:
    """An httpx client that ignores proxy variables: loopback traffic only."""
    return httpx.Client(trust_env=False, timeout=timeout, **kwargs)


def openai_client(base_url: str, api_key: str = "sk-none") -> Any:
    """The real OpenAI SDK, no retries, on its own HTTP stack (httpx2 from openai 3 on)."""
    import openai

    sdk_http: Any
    try:
        import httpx2 as sdk_http  # type: ignore[import-not-found,no-redef,unused-ignore]
    except ImportError:
        sdk_http = httpx
    client: Any = sdk_http.Client(trust_env=False, timeout=30.0)
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                         timeout=30.0, http_client=client)


def anthropic_client(base_url: str, api_key: str = "sk-acme") -> Any:
    """The real Anthropic SDK, no retries; its key goes as x-api-key, as Claude clients send it."""
    import anthropic

    return anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=60.0)


def streamed_chat(sdk: Any, **request: Any) -> tuple[dict[str, str], list[Any]]:
    """A streamed chat completion through the OpenAI SDK: the response's headers and chunks."""
    with sdk.chat.completions.with_streaming_response.create(stream=True, **request) as response:
        return dict(response.headers), list(response.parse())


def streamed_text(chunks: list[Any]) -> str:
    """The text the chunks of a streamed chat completion carry."""
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

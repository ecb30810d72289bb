"""Per-tenant limits (issue #15, item 8): a tenant over its concurrency gets a 429 with
Retry-After while another tenant is served; a line of waiters, bounded in length and time; a
cap on the text one prompt gives the template; overrides per tenant in the keys file."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from prefix_cache.service import ServiceSettings

from tests.support.loopback import local_client
from tests.support.server_thread import ServerThread
from tests.support.sidecar import bearer, served, sidecar_app, unique_system
from tests.support.tools import make_tools
from tests.support.waits import EVENT_TIMEOUT_S, wait_until


ACME, GLOBEX, INITECH = "sk-lim-acme", "sk-lim-globex", "sk-lim-initech"
PROMPT_LIMIT = 64 * 1024
KEYS = {
    "tenants": {ACME: "acme", GLOBEX: "globex", INITECH: "initech"},
    "tenant_limits": {"acme": {"max_concurrency": 1, "max_queue": 0},
                      "initech": {"max_concurrency": 1, "max_queue": 1,
                                  "max_prompt_bytes": 4 * PROMPT_LIMIT}},
}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Any) -> Any:
    keys = tmp_path_factory.mktemp("limits") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    return sidecar_app(served("demo", demo_tokenizer), keys_file=keys,
                       max_prompt_bytes=PROMPT_LIMIT, tenant_max_concurrency=4)


@pytest.fixture(scope="module")
def strict(demo_tokenizer: Any) -> Iterator[str]:
    """Every tenant: one request prepared at a time, none waiting (settings only)."""
    app = sidecar_app(served("demo", demo_tokenizer), api_keys={ACME: "acme", GLOBEX: "globex"},
                      tenant_max_concurrency=1, tenant_max_queue=0)
    with ServerThread(app) as url:
        yield url


def chat(system: dict[str, str] | None = None, user: Any = "Hi") -> dict[str, Any]:
    return {"messages": [system or unique_system(), {"role": "user", "content": user}],
            "tools": make_tools(2)}


@dataclass
class Held:
    sock: socket.socket
    rest: bytes


@contextmanager
def held_slot(base: str, key: str) -> Iterator[Held]:
    """A boundary request of ``key``'s tenant whose body is only half sent: the sidecar holds
    one of the tenant's slots while it waits for the rest. Sending the rest lets it finish."""
    raw = json.dumps(chat()).encode()
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=EVENT_TIMEOUT_S) as sock:
        sock.sendall(f"POST /v1/prefix/boundary HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw[:10])
        yield Held(sock, raw[10:])


def finish(held: Held) -> bytes:
    """Send the rest of the held body; the head of the answer."""
    held.sock.sendall(held.rest)
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = held.sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def wait_for_status(http: Any, key: str, status: int) -> Any:
    """Poll with fresh requests until one answers ``status`` (the held request must have
    reached the server first); bounded."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while True:
        r = http.post("/v1/prefix/boundary", json=chat(), headers=bearer(key))
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_a_tenant_over_its_limit_gets_429_while_another_is_served(strict: str) -> None:
    base = strict
    with local_client(base_url=base) as http, held_slot(base, ACME) as held:
        refused = wait_for_status(http, ACME, 429)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "tenant_concurrency_limit" and "acme" in error["message"]
        other = http.post("/v1/prefix/boundary", json=chat(), headers=bearer(GLOBEX))
        assert other.status_code == 200 and other.json()["cache"] == "miss"
        assert finish(held).startswith(b"HTTP/1.1 200")
        assert http.post("/v1/prefix/boundary", json=chat(),
                         headers=bearer(ACME)).status_code == 200   # the slot is free again


def test_the_sdk_sees_a_rate_limit_error_it_can_retry(base: str) -> None:
    openai = pytest.importorskip("openai")
    from tests.support.loopback import openai_client

    with held_slot(base, ACME) as held, local_client(base_url=base) as http:
        assert wait_for_status(http, ACME, 429).status_code == 429
        with pytest.raises(openai.RateLimitError) as info:
            openai_client(base, ACME).chat.completions.create(model="demo", **chat())
        assert info.value.response.headers["retry-after"] == "1"
        finish(held)


def test_waiters_are_served_in_turn_and_a_full_line_is_refused(app: Any, base: str) -> None:
    limits = app.state.service.limits
    with local_client(base_url=base) as http, held_slot(base, INITECH) as held:
        # initech: one slot, one place in line. The held request takes the slot ...
        assert wait_until(lambda: limits.active("initech") == 1)
        waiting: list[Any] = []
        thread = threading.Thread(target=lambda: waiting.append(http.post(
            "/v1/prefix/boundary", json=chat(), headers=bearer(INITECH))))
        thread.start()
        # ... a second request waits in line, and a third finds the line full.
        assert wait_until(lambda: limits.waiting("initech") == 1)
        third = http.post("/v1/prefix/boundary", json=chat(), headers=bearer(INITECH))
        assert third.status_code == 429 and "1 are waiting" in third.json()["error"]["message"]
        assert finish(held).startswith(b"HTTP/1.1 200")
        thread.join(timeout=EVENT_TIMEOUT_S)
        assert waiting and waiting[0].status_code == 200   # served once the slot passed on
    assert wait_until(lambda: limits.active("initech") == 0 and limits.waiting("initech") == 0)


def test_a_prompt_over_the_text_limit_is_a_413_before_any_render(base: str) -> None:
    with local_client(base_url=base) as http:
        r = http.post("/v1/prefix/boundary", json=chat(user="x" * (PROMPT_LIMIT + 1)),
                      headers=bearer(GLOBEX))
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "prompt_too_large"
        assert "PREFIX_CACHE_MAX_PROMPT_BYTES" in r.json()["error"]["message"]
        # Image data is not text the template renders: a large image passes.
        image = base64.b64encode(b"\x89PNG" + b"\0" * (2 * PROMPT_LIMIT)).decode()
        parts = [{"type": "text", "text": "What is this?"},
                 {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]
        assert http.post("/v1/prefix/boundary", json=chat(user=parts),
                         headers=bearer(GLOBEX)).status_code == 200
        # initech's own limit is four times larger.
        assert http.post("/v1/prefix/boundary", json=chat(user="x" * (PROMPT_LIMIT + 1)),
                         headers=bearer(INITECH)).status_code == 200


AGENT_BODIES = {
    "/v1/messages": lambda user: {"model": "demo", "max_tokens": 8, "system": "Be brief.",
                                  "messages": [{"role": "user", "content": user}]},
    "/v1/messages/count_tokens": lambda user: {"model": "demo", "system": "Be brief.",
                                               "messages": [{"role": "user", "content": user}]},
    "/v1/responses": lambda user: {"model": "demo", "instructions": "Be brief.", "input": user},
}


@pytest.mark.parametrize("path", sorted(AGENT_BODIES))
def test_the_agent_apis_share_the_tenants_slots_and_prompt_limit(strict: str, base: str,
                                                                 path: str) -> None:
    body = AGENT_BODIES[path]
    with local_client(base_url=strict) as http, held_slot(strict, ACME) as held:
        # acme's one slot is held by a boundary request: the agent API is refused, not queued.
        assert wait_for_status(http, ACME, 429).status_code == 429
        refused = http.post(path, json=body("Hi"), headers=bearer(ACME))
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        finish(held)
    if path != "/v1/messages/count_tokens":
        return  # the demo model has no upstream to generate with; the prompt check is shared
    with local_client(base_url=base) as http:
        r = http.post(path, json=body("x" * (PROMPT_LIMIT + 1)), headers=bearer(GLOBEX))
        assert r.status_code == 413, r.text
        assert "PREFIX_CACHE_MAX_PROMPT_BYTES" in r.json()["error"]["message"]


def test_prompt_bytes_counts_the_text_a_template_renders() -> None:
    from prefix_cache.service.limits import prompt_bytes

    messages = [{"role": "system", "content": "abc"},
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": "x" * 999}}]}]
    small = prompt_bytes(messages, None, None)
    assert small < 200
    assert prompt_bytes(messages, make_tools(4), None) > small + 4 * 100
    assert prompt_bytes(messages, None, {"big": "y" * 1000}) > small + 1000


# -- the limiter itself ---------------------------------------------------------------------------


def limits(concurrency: int = 1, queue: int = 1, timeout_s: float = 5.0) -> Any:
    from prefix_cache.service.limits import TenantLimit, TenantLimits

    return TenantLimits(TenantLimit(concurrency, queue, 1 << 20), queue_timeout_s=timeout_s)


async def test_a_waiter_that_waits_too_long_gets_a_429() -> None:
    from prefix_cache.http.errors import TooManyRequests

    lim = limits(timeout_s=0.05)
    async with lim.slot("t"):
        with pytest.raises(TooManyRequests, match="no slot freed"):
            async with lim.slot("t"):
                pass
    async with lim.slot("t"):   # the timed-out waiter left the line and the slot is free
        pass


async def test_a_cancelled_waiter_leaves_the_line_and_slots_are_never_lost() -> None:
    lim = limits(concurrency=2, queue=8)
    entered = 0
    release = asyncio.Event()

    async def use() -> None:
        nonlocal entered
        async with lim.slot("t"):
            entered += 1
            await release.wait()

    tasks = [asyncio.create_task(use()) for _ in range(6)]
    await asyncio.sleep(0.01)
    assert entered == 2
    tasks[3].cancel()           # one in line goes away
    release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert entered == 5 and isinstance(results[3], asyncio.CancelledError)
    assert lim.active("t") == 0 and lim.waiting("t") == 0   # every slot came back


def test_keys_file_limits_are_checked(tmp_path: Path) -> None:
    from prefix_cache.service.limits import TenantLimit, TenantLimitOverride, TenantLimits
    from prefix_cache.service.tenants import KeysConfig

    path = tmp_path / "keys.json"
    for bad, message in (({"nobody": {"max_concurrency": 2}}, "no API key maps to"),
                         ({"acme": {"max_concurrency": 0}}, "max_concurrency"),
                         ({"acme": {"concurrency": 2}}, "concurrency"),
                         ([1], "must map tenant names")):
        path.write_text(json.dumps({"tenants": {"k": "acme"}, "tenant_limits": bad}))
        with pytest.raises(ValueError, match=message):
            KeysConfig.load(ServiceSettings(keys_file=path))
    path.write_text(json.dumps({"tenants": {"k": "acme"},
                                "tenant_limits": {"acme": {"max_queue": 0}}}))
    config = KeysConfig.load(ServiceSettings(keys_file=path, tenant_max_concurrency=3))
    assert config.tenant_limits == {"acme": TenantLimitOverride(max_queue=0)}
    lim = TenantLimits.from_settings(ServiceSettings(tenant_max_concurrency=3),
                                     config.tenant_limits)
    assert lim.of("acme") == TenantLimit(3, 0, lim.default.max_prompt_bytes)
    assert lim.of("other") == lim.default

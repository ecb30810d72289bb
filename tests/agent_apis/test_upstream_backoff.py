"""An upstream's error reaches the client with what its backoff reads: ``Retry-After``,
``retry-after-ms``, ``x-should-retry``, the rate limits and the upstream's request id, on chat
completions, Messages and Responses, streamed or not, relayed or converted; the real OpenAI and
Anthropic SDKs then wait as long as the upstream said."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.agent_upstream import AgentRecorder
from tests.support.loopback import anthropic_client, local_client, openai_client

anthropic = pytest.importorskip("anthropic", reason="the Anthropic SDK is the client under test")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

UPSTREAM_ID = "req_upstream_7f3a"
BACKOFF = {"retry-after": "2", "retry-after-ms": "2000", "x-should-retry": "true",
           "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "0",
           "x-ratelimit-reset-requests": "2s", "anthropic-ratelimit-requests-remaining": "0",
           "request-id": UPSTREAM_ID}
PRIVATE = {"set-cookie": "session=upstream-secret", "x-internal-node": "gpu-rack-7",
           "via": "1.1 upstream-proxy"}
SDK_WAIT_S = 1.5   # what the upstream asks for below; the SDKs' own first backoff is under 1 s


@pytest.fixture(scope="module")
def app(agent_app: Any) -> Any:
    return agent_app  # the sidecar the module's ``base`` serves (tests/support/service_fixtures)


def request_of(api: str, model: str, stream: bool) -> tuple[str, dict[str, Any]]:
    """The path and body of a one-line request of ``api``."""
    user = [{"role": "user", "content": "x"}]
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": user, "stream": stream}
    if api == "messages":
        return "/v1/messages", {"model": model, "max_tokens": 4, "messages": user,
                                "stream": stream}
    return "/v1/responses", {"model": model, "input": "x", "stream": stream}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("model", ["native", "chat-only"])   # relayed as is / converted
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
@pytest.mark.parametrize("status", [429, 503])
def test_an_upstream_error_keeps_the_headers_a_backoff_reads(
        base: str, rec: AgentRecorder, api: str, model: str, stream: bool, status: int) -> None:
    rec.error = (status, {"error": {"message": "slow down", "type": "rate_limit",
                                    "code": "rate_limited"}})
    rec.error_headers = {**BACKOFF, **PRIVATE, "x-request-id": "req_their_own"}
    path, body = request_of(api, model, stream)
    with local_client(base_url=base, headers={"authorization": "Bearer sk-acme",
                                              "x-request-id": "client-trace-1"}) as http:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    relayed = {name: r.headers.get(name) for name in BACKOFF}
    assert relayed == BACKOFF
    assert not set(PRIVATE) & set(r.headers), "the upstream's private headers leaked"
    # Ours stays the one in our logs (and sent upstream); theirs comes beside it.
    assert r.headers["x-request-id"] == "client-trace-1"
    assert r.headers["x-upstream-request-id"] == "req_their_own"
    assert rec.requests, "the request never reached the upstream"
    error = r.json()["error"]
    assert error["message"] == "slow down"   # in the API's shape (Anthropic's or OpenAI's)


def test_an_upstream_that_echoes_our_request_id_adds_no_second_one(
        base: str, rec: AgentRecorder) -> None:
    rec.error = (429, {"error": {"message": "later", "type": "rate_limit"}})
    rec.error_headers = {"retry-after": "1", "x-request-id": "client-trace-2"}
    with local_client(base_url=base, headers={"authorization": "Bearer sk-acme",
                                              "x-request-id": "client-trace-2"}) as http:
        r = http.post(*request_of("chat", "native", False)[:1],
                      json=request_of("chat", "native", False)[1])
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.headers["x-request-id"] == "client-trace-2"
    assert "x-upstream-request-id" not in r.headers


def waited_s(rec: AgentRecorder) -> float:
    """How long the client waited between its failed request and its retry."""
    assert len(rec.arrived_at) == 2, f"{len(rec.arrived_at)} requests reached the upstream"
    return rec.arrived_at[1] - rec.arrived_at[0]


def fail_once(rec: AgentRecorder) -> None:
    rec.error = (429, {"type": "error", "error": {"type": "rate_limit_error",
                                                  "message": "wait a bit"}})
    rec.error_headers = {"retry-after-ms": str(int(SDK_WAIT_S * 1000)),
                         "retry-after": str(int(SDK_WAIT_S + 1))}
    rec.errors_left = 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("model", ["native", "chat-only"])
def test_the_openai_sdk_retries_when_the_upstream_said(base: str, rec: AgentRecorder,
                                                       model: str, stream: bool) -> None:
    sdk = openai_client(base, "sk-acme").with_options(max_retries=1)
    fail_once(rec)
    chat = sdk.chat.completions.create(model=model, stream=stream,
                                       messages=[{"role": "user", "content": "x"}])
    if stream:
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == "recorded"
    else:
        assert chat.choices[0].message.content == "recorded"
    assert waited_s(rec) >= SDK_WAIT_S
    rec.arrived_at.clear()
    fail_once(rec)
    response = sdk.responses.create(model=model, input="x", stream=stream)
    if stream:
        assert [e.type for e in response][-1] == "response.completed"
    else:
        assert response.output_text == "recorded"
    assert waited_s(rec) >= SDK_WAIT_S


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("model", ["native", "chat-only"])
def test_the_anthropic_sdk_retries_when_the_upstream_said(base: str, rec: AgentRecorder,
                                                          model: str, stream: bool) -> None:
    sdk = anthropic_client(base).with_options(max_retries=1)
    fail_once(rec)
    message = sdk.messages.create(model=model, max_tokens=4, stream=stream,
                                  messages=[{"role": "user", "content": "x"}])
    if stream:
        assert [e.type for e in message][-1] == "message_stop"
    else:
        assert message.content[0].text == "recorded"
    assert waited_s(rec) >= SDK_WAIT_S


def test_the_sdks_errors_name_the_request_ids(base: str, rec: AgentRecorder) -> None:
    rec.error = (429, {"type": "error", "error": {"type": "rate_limit_error",
                                                  "message": "no more"}})
    rec.error_headers = {"request-id": UPSTREAM_ID, "x-request-id": "req_openai_side",
                         "retry-after": "30"}
    with pytest.raises(anthropic.RateLimitError) as on_messages:
        anthropic_client(base).messages.create(model="native", max_tokens=4,
                                               messages=[{"role": "user", "content": "x"}])
    assert on_messages.value.request_id == UPSTREAM_ID
    assert on_messages.value.response.headers["retry-after"] == "30"
    with pytest.raises(openai.RateLimitError) as on_chat:
        openai_client(base, "sk-acme").chat.completions.create(
            model="chat-only", messages=[{"role": "user", "content": "x"}])
    headers = on_chat.value.response.headers
    assert on_chat.value.request_id == headers["x-request-id"] != "req_openai_side"  # ours
    assert headers["x-upstream-request-id"] == "req_openai_side"
    assert headers["retry-after"] == "30"

"""Request-level metrics (issue 40, part 1): status, end-to-end latency, time to first token and
token counts of each API request, by API, model, cache result and tenant; the same from an
upstream's usage (relayed or converted) as from the in-process engine's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_cache.chat.anthropic_encode import MessageMeta, message_stream
from prefix_cache.chat.events import Finish, OutputEvent, Prefilled, TextDelta
from prefix_cache.chat.openai_encode import ChatMeta, completion_stream
from prefix_cache.chat.responses_encode import ResponseMeta, response_stream
from prefix_cache.engine.protocol import Usage
from prefix_cache.http.request_record import RequestRecord
from prefix_cache.http.usage_tap import UsageTap
from prefix_cache.service.upstream import Upstream
from tests.support.recording_upstream import Recorder
from tests.support.sidecar import TENANT_KEYS, bearer, served, sidecar_app, unique_system
from tests.support.waits import wait_until

ACME = "sk-acme"
METRICS_KEY = "sk-req-metrics"
ADMIN_KEY = "sk-req-admin"


@pytest.fixture(scope="module")
def app(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> Any:
    url = recorder_server[1]
    return sidecar_app(served("rec", demo_tokenizer, Upstream(url)),
                       api_keys=TENANT_KEYS, metrics_keys=[METRICS_KEY],
                       admin_keys=[ADMIN_KEY])


def samples(http: Any) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics", headers=bearer(METRICS_KEY)).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(found: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in found.items()
               if n == name and set(labels.items()) <= set(ls))


def chat(system: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {"model": "rec", "messages": [system, {"role": "user", "content": "hi"}], **extra}


def test_a_relayed_answer_counts_its_usage_ttft_and_status(http: Any, recorder: Recorder) -> None:
    system = unique_system("reqm")
    before = samples(http)
    for _ in range(2):  # a miss, then a hit
        assert http.post("/v1/chat/completions", json=chat(system),
                         headers=bearer(ACME)).status_code == 200
    after = samples(http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    common = {"api": "chat", "model": "rec", "tenant": "acme"}
    for cache in ("miss", "hit"):
        assert delta("prefix_cache_http_requests_total", cache=cache, status="200",
                     **common) == 1
        assert delta("prefix_cache_e2e_request_latency_seconds_count", cache=cache,
                     **common) == 1
        assert delta("prefix_cache_time_to_first_token_seconds_count", cache=cache,
                     **common) == 1
    # The recording upstream's usage: one prompt token, one generated, none cached.
    assert delta("prefix_cache_prompt_tokens_total", **common) == 2
    assert delta("prefix_cache_generation_tokens_total", **common) == 2
    assert delta("prefix_cache_prompt_tokens_cached_total", **common) == 0
    assert delta("prefix_cache_e2e_request_latency_seconds_sum", **common) > 0


def test_a_relayed_stream_without_usage_counts_the_prompt_the_sidecar_cut(
        http: Any, recorder: Recorder) -> None:
    before = samples(http)
    r = http.post("/v1/chat/completions", json=chat(unique_system("reqs"), stream=True),
                  headers=bearer(ACME))
    assert r.status_code == 200 and "data: [DONE]" in r.text
    after = samples(http)
    prompt = (value(after, "prefix_cache_prompt_tokens_total", api="chat", cache="miss")
              - value(before, "prefix_cache_prompt_tokens_total", api="chat", cache="miss"))
    assert prompt > 5  # the demo template's rendering of the prompt, counted here
    ttft = ("prefix_cache_time_to_first_token_seconds_count", {"api": "chat", "cache": "miss"})
    assert value(after, ttft[0], **ttft[1]) - value(before, ttft[0], **ttft[1]) == 1


def test_a_converted_answer_counts_the_upstreams_usage(http: Any, recorder: Recorder) -> None:
    """Messages sent on as a chat completion (the upstream speaks only chat): its usage."""
    before = samples(http)
    body = {"model": "rec", "max_tokens": 8, "system": unique_system("reqa")["content"],
            "messages": [{"role": "user", "content": "hi"}]}
    r = http.post("/v1/messages", json=body, headers=bearer(ACME))
    assert r.status_code == 200, r.text
    after = samples(http)
    for name, expected in (("prefix_cache_prompt_tokens_total", 1),
                           ("prefix_cache_generation_tokens_total", 1),
                           ("prefix_cache_http_requests_total", 1)):
        assert (value(after, name, api="messages", model="rec", tenant="acme")
                - value(before, name, api="messages", model="rec", tenant="acme")) == expected


def test_refused_requests_are_counted_by_status(http: Any) -> None:
    before = samples(http)
    assert http.post("/v1/chat/completions", json=chat(unique_system()),
                     headers=bearer("sk-nobody")).status_code == 401
    assert http.post("/v1/chat/completions", json={"model": "nope", "messages": []},
                     headers=bearer(ACME)).status_code in (400, 404)
    after = samples(http)
    name = "prefix_cache_http_requests_total"
    assert value(after, name, status="401", tenant="") - value(before, name, status="401",
                                                               tenant="") == 1
    refused = sum(value(after, name, status=s, tenant="acme", model="")
                  - value(before, name, status=s, tenant="acme", model="") for s in ("400", "404"))
    assert refused == 1
    # A refused request generated nothing and has no time to first token.
    assert value(after, "prefix_cache_time_to_first_token_seconds_count", tenant="") == 0


def test_admin_stats_report_each_tenants_usage_for_billing(http: Any, recorder: Recorder) -> None:
    def answered(found: dict[tuple[str, tuple], float], tenant: str) -> float:
        return value(found, "prefix_cache_http_requests_total", tenant=tenant, status="200")

    before = samples(http)
    for key in (ACME, "sk-globex"):
        assert http.post("/v1/chat/completions", json=chat(unique_system("bill")),
                         headers=bearer(key)).status_code == 200
    # A request is recorded once its answer has gone out: the client may read before that.
    wait_until(lambda: all(answered(samples(http), t) > answered(before, t)
                           for t in ("acme", "globex")), "both requests recorded")
    found = samples(http)
    usage = {row["tenant"]: row for row in
             http.get("/admin/stats", headers=bearer(ADMIN_KEY)).json()["usage"]}
    assert set(usage) >= {"acme", "globex"}
    for tenant in ("acme", "globex"):
        assert usage[tenant]["requests"] == answered(found, tenant) >= 1
        assert usage[tenant]["prompt_tokens"] == value(found, "prefix_cache_prompt_tokens_total",
                                                       tenant=tenant) >= 1
        assert usage[tenant]["generated_tokens"] == value(
            found, "prefix_cache_generation_tokens_total", tenant=tenant) >= 1
        assert usage[tenant]["cached_tokens"] == usage[tenant]["reused_tokens"] == 0
        # What a platform bills and what the cache saved it: computed + reused = prompt.
        assert usage[tenant]["computed_tokens"] == usage[tenant]["prompt_tokens"]


# -- the relay's usage, in each API's stream, cut anywhere --------------------------------------


async def _events(usage: Usage) -> AsyncIterator[OutputEvent]:
    yield Prefilled(Usage(usage.prompt_tokens, 0, usage.cached_tokens))
    yield TextDelta("Hello")
    yield TextDelta(" world")
    yield Finish("stop", usage)


async def _stream_bytes(api: str, usage: Usage) -> bytes:
    if api == "chat":
        stream = completion_stream(ChatMeta("m", include_usage=True), _events(usage))
    elif api == "messages":
        stream = message_stream(MessageMeta("msg_1", "m", Usage(usage.prompt_tokens, 0,
                                                                usage.cached_tokens)),
                                _events(usage))
    else:
        async def done(_: dict[str, Any]) -> None:
            return None
        stream = response_stream(ResponseMeta("resp_1", "m"), _events(usage), done)
    return b"".join([chunk async for chunk in stream])


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
@pytest.mark.parametrize("cut", [1, 7, 64, 100_000])
def test_the_usage_tap_reads_every_apis_stream(api: str, cut: int) -> None:
    usage = Usage(prompt_tokens=120, completion_tokens=9, cached_tokens=100)
    data = asyncio.run(_stream_bytes(api, usage))

    async def feed() -> RequestRecord:
        record = RequestRecord(api, 0.0, prompt_tokens=3)
        tap = UsageTap(record, streamed=True)
        for i in range(0, len(data), cut):
            await tap.feed(data[i:i + cut])
        await tap.end()
        return record

    record = asyncio.run(feed())
    assert (record.prompt_tokens, record.cached_tokens, record.generation_tokens) == (120, 100, 9)
    assert record.first_content is not None
    assert len(record.content_gaps) == 1   # two pieces of content: one inter-token gap
    assert record.finish_reason == "stop"

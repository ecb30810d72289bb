"""Request-level metrics (issue 40) on the in-process MLX engine (``serve --engine mlx``):
the engine's own usage (prompt, reused, generated tokens) and TTFT, per tenant, streamed and
not. The model is the tiny random-weights one: counts are checked, never text."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

from tests.support.loopback import local_client, openai_client, streamed_chat  # noqa: E402
from tests.support.service_fixtures import ENGINE_METRICS, TINY_MODEL  # noqa: E402
from tests.support.sidecar import bearer, unique_system  # noqa: E402


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with local_client(base_url=url) as http:
        text = http.get("/metrics", headers=bearer(ENGINE_METRICS)).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(found: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in found.items() if n == name and set(labels.items()) <= set(ls))


def test_the_engines_usage_and_ttft_are_counted(engine_sidecar: tuple[str, Any]) -> None:
    url, _ = engine_sidecar
    sdk = openai_client(url, "sk-globex")
    system = {"role": "system", "content": unique_system()["content"] + " Be brief. " * 40}
    before = scrape(url)
    first = sdk.chat.completions.create(model=TINY_MODEL, max_tokens=3, temperature=0.0,
                                        messages=[system, {"role": "user", "content": "One."}])
    headers, _ = streamed_chat(sdk, model=TINY_MODEL, max_tokens=3, temperature=0.0,
                               messages=[system, {"role": "user", "content": "Two."}])
    assert headers["x-prefix-cache"] == "hit"
    after = scrape(url)
    labels = {"api": "chat", "model": TINY_MODEL, "tenant": "globex"}

    def delta(name: str, **more: str) -> float:
        return total(after, name, **labels, **more) - total(before, name, **labels, **more)

    second_prompt = delta("prefix_cache_prompt_tokens_total", cache="hit")
    assert delta("prefix_cache_prompt_tokens_total", cache="miss") == first.usage.prompt_tokens
    assert second_prompt > 0
    # The second turn reuses the first's static-prefix KV: the engine reports it cached.
    assert 0 < delta("prefix_cache_prompt_tokens_cached_total", cache="hit") <= second_prompt
    generated = delta("prefix_cache_generation_tokens_total")
    assert first.usage.completion_tokens < generated <= first.usage.completion_tokens + 3
    for cache in ("miss", "hit"):
        assert delta("prefix_cache_time_to_first_token_seconds_count", cache=cache) == 1
        assert delta("prefix_cache_http_requests_total", cache=cache, status="200") == 1
    ttft = delta("prefix_cache_time_to_first_token_seconds_sum")
    assert 0 < ttft <= delta("prefix_cache_e2e_request_latency_seconds_sum")
    # Not streamed, TTFT is the first token the engine generated, not the whole answer.
    assert (delta("prefix_cache_time_to_first_token_seconds_sum", cache="miss")
            < delta("prefix_cache_e2e_request_latency_seconds_sum", cache="miss"))
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert delta(f"prefix_cache_{name}_count") == 2, name
    # One gap between two tokens: as many as the tokens after each answer's first.
    assert delta("prefix_cache_inter_token_latency_seconds_count") == generated - 2
    reasons = {r: delta("prefix_cache_request_success_total", finished_reason=r)
               for r in ("stop", "length", "tool_calls", "abort")}
    assert sum(reasons.values()) == 2 and reasons["abort"] == reasons["tool_calls"] == 0
    assert total(after, "prefix_cache_num_requests_running") == 0
    assert total(after, "prefix_cache_num_requests_waiting") == 0
    assert 0 < total(after, "prefix_cache_kv_cache_usage_perc", model=TINY_MODEL) < 1

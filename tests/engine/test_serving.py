"""Serving the MLX engine: OpenAI chat completions over it, in-process behind the sidecar
(``serve --engine mlx``), as its own server (``serve-engine``), and a sidecar in front of that.

The client is the real OpenAI SDK against real uvicorn on loopback; the model is the tiny
random-weights one (float32), so what is checked is plumbing, counts and KV reuse, never text.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

from engine_adapter.backend import MLXBackend  # noqa: E402
from engine_adapter.decoding import IncrementalDecoder  # noqa: E402
from engine_adapter.engine_host import Namespaces  # noqa: E402
from engine_adapter.server import create_engine_app  # noqa: E402
from prefix_cache.chat.events import backend_events  # noqa: E402
from prefix_cache.chat.openai_encode import ChatMeta, completion_json  # noqa: E402
from prefix_cache.chat.openai_params import parse_chat_body  # noqa: E402
from prefix_cache.errors import ContextLengthError, InvalidRequestError  # noqa: E402
from prefix_cache.http.errors import BadRequest  # noqa: E402
from prefix_cache.model_folders.model_dir import load_tokenizer  # noqa: E402
from prefix_cache.render.render import get_renderer  # noqa: E402
from prefix_cache.service.upstream import Upstream  # noqa: E402

from tests.support.browser import (  # noqa: E402
    CHROMEDRIVER,
    CHROMIUM,
    browser_errors,
    headless_chromium,
    wait_for_js,
)
from tests.support.grafana import queried_metrics  # noqa: E402
from tests.support.loopback import (  # noqa: E402
    local_client,
    openai_client,
    streamed_chat,
    streamed_text,
)
from tests.support.paths import ARTIFACTS  # noqa: E402
from tests.support.paths import REPO  # noqa: E402
from tests.support.scripted_engine import ScriptedEngine  # noqa: E402
from tests.support.serve_process import ServeProcess  # noqa: E402
from tests.support.server_thread import ServerThread  # noqa: E402
from tests.support.service_fixtures import ENGINE_ADMIN, ENGINE_METRICS, TINY_MODEL  # noqa: E402
from tests.support.sidecar import (  # noqa: E402
    TENANT_KEYS,
    bearer,
    engine_sidecar_app,
    served,
    sidecar_app,
    unique_system,
)
from tests.support.tools import make_tools  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402


def chat(system: dict[str, str], user: str) -> list[dict[str, str]]:
    return [system, {"role": "user", "content": user}]


# -- the OpenAI layer on a scripted engine ----------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


async def run(backend: MLXBackend, body: dict[str, Any]) -> dict[str, Any]:
    call = parse_chat_body(body, run_here=True).call
    request = backend.check(call.backend_request([1, 2, 3], 2, "default"))
    return await completion_json(ChatMeta(backend.name), backend_events(backend, request))


def test_incremental_decoder_never_splits_a_character(tokenizer: Any) -> None:
    text = "naïve café: 世界 🎉🎉 ok — done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.add(t) for t in ids] + [decoder.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 5  # incremental, not all at the end


async def test_stop_strings_end_the_completion_and_cancel(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world. The END is near, friend.", add_special_tokens=False)
    engine = ScriptedEngine(ids, stop_token_ids=(tokenizer.eos_token_id,))
    chat_engine = MLXBackend(engine, tokenizer)
    out = await run(chat_engine, {"stop": ["END", "never"], "max_tokens": 50})
    assert out["choices"][0]["message"]["content"] == "Hello world. The "
    assert out["choices"][0]["finish_reason"] == "stop"
    assert engine.closed_early  # the engine's iterator was closed: MLXEngine cancels there
    # Text that only starts like a stop string is held back, then released.
    engine = ScriptedEngine(ids, stop_token_ids=())
    out = await run(MLXBackend(engine, tokenizer), {"stop": "ENDING"})
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(ids)
    assert out["choices"][0]["finish_reason"] == "length" and not engine.closed_early


async def test_end_of_turn_token_is_a_stop_and_not_text(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    chat_engine = MLXBackend(ScriptedEngine([*ids, eos], (eos,), finish="stop"), tokenizer)
    out = await run(chat_engine, {"max_completion_tokens": 9})
    assert out["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "Hi there"}}
    assert out["usage"]["completion_tokens"] == len(ids) + 1
    assert out["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("body, fragment", [
    ({"n": 2}, "n > 1"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"stop": [1]}, "stop"), ({"logprobs": True}, "logprobs"),
    ({"stream": "yes"}, "stream"), ({"seed": 1.5}, "seed"),
])
def test_bad_parameters_are_400s(tokenizer: Any, body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        parse_chat_body(body, run_here=True)


def test_max_tokens_must_fit_in_the_context_and_the_default_is_cut_to_it(tokenizer: Any) -> None:
    engine = ScriptedEngine([], ())
    engine.context_length = 10
    chat_engine = MLXBackend(engine, tokenizer, default_max_tokens=512)
    prompt = [1, 2, 3]

    def max_tokens(body: dict[str, Any], ids: list[int], namespace: str) -> int | None:
        request = parse_chat_body(body, run_here=True).call.backend_request(ids, 0, namespace)
        return chat_engine.check(request).request.sampling.max_tokens

    assert max_tokens({}, prompt, "default") == 7  # 10 - 3 left
    assert max_tokens({"max_tokens": 7}, prompt, "d") == 7
    with pytest.raises(ContextLengthError, match="ask for at most 7") as info:
        max_tokens({"max_tokens": 8}, prompt, "default")
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthError, match="the prompt has 10 tokens") as info:
        max_tokens({}, list(range(10)), "default")
    assert info.value.code == "context_length_exceeded"


def test_namespace_is_read_only_when_trusted() -> None:
    body = {"specprefill_namespace": "acme"}
    assert Namespaces(trust=False).of(body) == "default"
    assert Namespaces(trust=True).of(body) == "acme"
    assert Namespaces(trust=True).of({}) == "default"
    with pytest.raises(BadRequest, match="specprefill_namespace"):
        Namespaces(trust=True).of({"specprefill_namespace": "a:b"})


def test_prefix_cache_imports_no_mlx_until_an_engine_is_asked_for() -> None:
    code = ("import sys, prefix_cache.cli, prefix_cache.service.app, prefix_cache.service.server;"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'mlx' or m.startswith("
            "'engine_adapter.')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# -- (a) in-process behind the sidecar: serve --engine mlx ------------------------------------


def test_sidecar_streams_from_the_in_process_engine(engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, _ = engine_sidecar
    sdk = openai_client(url, "sk-acme")
    headers, chunks = streamed_chat(sdk, model=TINY_MODEL, tools=make_tools(2), max_tokens=6,
                                    messages=chat(unique_system(), "Stream."), temperature=0.0)
    assert headers["x-prefix-cache"] == "miss"
    assert int(headers["x-specprefill-system-end"]) > 0
    assert len(chunks) >= 3 and streamed_text(chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_readyz_reports_the_in_process_engine(engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, engine = engine_sidecar
    with local_client(base_url=url) as http:
        r = http.get("/readyz", headers=bearer(ENGINE_METRICS))
    assert r.status_code == 200 and r.json()["status"] == "ready"
    report = r.json()["engines"][TINY_MODEL]
    assert report["ok"] is True and report["active"] == 0 and report["queued"] == 0
    assert report["disk_full"] is False          # its KV disk tier writes (a full one: True)
    assert engine.health()["ok"] is True


def test_metrics_export_the_engine_counters(engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, engine = engine_sidecar
    sdk = openai_client(url, "sk-acme")
    sdk.chat.completions.create(model=TINY_MODEL, messages=chat(unique_system(), "Count me."),
                                max_tokens=2, temperature=0.0)
    assert engine.engine.kv_disk.flush()     # its writes are done: the counts stay put
    with local_client(base_url=url) as http:
        text = http.get("/metrics", headers=bearer(ENGINE_METRICS)).text
        stats_json = http.get("/dashboard/stats.json",
                              headers=bearer(ENGINE_ADMIN))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    stats = engine.snapshot_stats()          # no request runs meanwhile: the same counts
    model = (("model", TINY_MODEL),)
    assert samples[("prefix_cache_engine_requests_total", model)] == stats.requests >= 1
    assert samples[("prefix_cache_engine_prompt_tokens_total", (("kind", "computed"), *model))] \
        == stats.prefilled_tokens > 0
    assert samples[("prefix_cache_engine_kv_entries", (*model, ("store", "static")))] \
        == stats.kv_store.entries
    assert stats_json.status_code == 200
    # the dashboard's rows
    assert stats_json.json()["engines"] == [{"model": TINY_MODEL, **stats.as_dict()}]
    engine_queries = {m for m in queried_metrics()
                      if m.startswith(("prefix_cache_engine_", "prefix_cache_kv_cache_usage_perc"))}
    assert engine_queries and engine_queries <= {name for name, _ in samples}


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="Debian chromium/chromedriver not installed")
def test_the_dashboard_page_shows_the_in_process_engine(
        engine_sidecar: tuple[str, MLXBackend]) -> None:
    pytest.importorskip("selenium.webdriver")
    url, engine = engine_sidecar
    openai_client(url, "sk-globex").chat.completions.create(
        model=TINY_MODEL, messages=chat(unique_system(), "Show me."), max_tokens=2, temperature=0.0)
    assert engine.engine.kv_disk.flush()
    stats = engine.snapshot_stats()
    with headless_chromium() as driver:
        host = url.removeprefix("http://")             # the login prompt's answer
        driver.get(f"http://admin:{ENGINE_ADMIN}@{host}/dashboard?poll_ms=300")
        wait_for_js(driver, "return window.dashboard && window.dashboard.renders >= 1")
        assert driver.find_element("id", "engines").is_displayed()
        # The engine's KV tiers over time (the history samples them every few seconds).
        wait_for_js(driver, "const h = window.dashboard.history; return h && "
                    f"h.engines.length === 1 && h.engines[0] === '{TINY_MODEL}' && "
                    "window.dashboard.charts['chart-kv-bytes'].data[1].some(v => v > 0)")
        assert driver.find_element("id", "chart-kv-bytes").is_displayed()
        cells = driver.execute_script(
            "return [...document.querySelectorAll('#engines tbody tr')].map("
            "r => [...r.children].map(c => c.textContent))")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "dashboard-engine.png"))
        assert not browser_errors(driver)
    assert len(cells) == 1
    model, active, requests, generated, reused = cells[0][:5]
    assert (model, active) == (TINY_MODEL, "0")
    assert requests == f"{stats.requests:,}" and generated == f"{stats.generated_tokens:,}"
    prompt = stats.reused_tokens + stats.prefilled_tokens
    assert reused == f"{stats.reused_tokens / prompt * 100:.1f}%"
    disk = cells[0][-1]                      # the KV disk tier, on by default
    assert f" in {stats.kv_disk.entries:,} · " in disk and disk.endswith(" dropped")


def test_a_closed_engine_is_not_healthy(tokenizer: Any) -> None:
    chat_engine = MLXBackend(ScriptedEngine([1], (0,)), tokenizer, name="scripted")
    assert chat_engine.health() == {"ok": True}         # an engine without a report of its own
    with ServerThread(create_engine_app(chat_engine)) as url, local_client(base_url=url) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/healthz").json() == {"status": "ok"}     # as the sidecar's probes
        assert http.get("/readyz").json() == {"status": "ready"}
        chat_engine.close()
        r, live, ready = http.get("/health"), http.get("/healthz"), http.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    assert r.json()["engine"]["ok"] is False and chat_engine.engine.closed
    assert live.status_code == 200 and live.json() == {"status": "ok"}  # the process is up
    assert ready.status_code == 503 and ready.json()["status"] == "not_ready"
    assert ready.json()["engine"]["ok"] is False


def test_serve_engine_mlx_command_streams_a_chat_completion(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    """The command as an operator runs it, in its own process: ``prefix-cache serve --engine
    mlx --model DIR`` loads the engine, reports it ready and streams tokens from it."""
    server = ServeProcess(["--model", str(tiny_model_dir), "--engine", "mlx"], tmp_path / "home")
    try:
        url = server.base_url()
        body = {"model": TINY_MODEL, "messages": chat(unique_system(), "Stream, please."),
                "tools": make_tools(2), "max_tokens": 5, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        with local_client(base_url=url) as http:
            ready = http.get("/readyz")
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                status, headers = response.status_code, response.headers
                lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert ready.status_code == 200 and ready.json()["engines"][TINY_MODEL]["ok"] is True
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert headers["x-prefix-cache"] == "miss" and int(headers["x-specprefill-system-end"]) > 0
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        assert deltas[0]["delta"]["role"] == "assistant"
        assert deltas[-1]["finish_reason"] in ("length", "stop")
        usage = chunks[-1]["usage"]
        assert 1 <= usage["completion_tokens"] <= 5 and usage["prompt_tokens"] > 0
    finally:
        code = server.stop()
    assert code == 0, "".join(server.log)


def test_sidecar_reuses_static_kv_per_tenant(engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, engine = engine_sidecar
    system, tools = unique_system(), make_tools(3)
    acme, globex = openai_client(url, "sk-acme"), openai_client(url, "sk-globex")

    def complete(sdk: Any, user: str) -> tuple[Any, Any]:
        raw = sdk.chat.completions.with_raw_response.create(
            model=TINY_MODEL, messages=chat(system, user), tools=tools, max_tokens=3,
            temperature=0.7, top_p=0.9, seed=3)
        return raw, raw.parse()

    complete(acme, "First turn.")
    before = engine.snapshot_stats().reused_tokens
    raw, completion = complete(acme, "Second turn, other words.")
    assert raw.headers["x-prefix-cache"] == "hit"
    with local_client(base_url=url, headers=bearer("sk-acme")) as http:
        boundary = http.post("/v1/prefix/boundary", json={
            "model": TINY_MODEL, "messages": chat(system, "Second turn, other words."),
            "tools": tools}).json()
    assert completion.usage.prompt_tokens == boundary["prompt_tokens"]
    end = boundary["specprefill_system_end"]
    assert raw.headers["x-specprefill-system-end"] == str(end) and end > 0
    assert completion.usage.prompt_tokens_details.cached_tokens == end
    assert completion.usage.completion_tokens <= 3
    stats = engine.snapshot_stats()
    assert stats.reused_tokens - before == end > 0
    # Another tenant, the very same system prompt and tools: no entry of acme's is used.
    raw, completion = complete(globex, "Second turn, other words.")
    assert raw.headers["x-prefix-cache"] == "miss"
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    after = engine.snapshot_stats()
    assert after.reused_tokens == stats.reused_tokens
    assert {"acme", "globex"} <= set(after.kv_store.by_namespace)


def test_the_admin_purge_removes_a_tenants_engine_kv_files(engine_sidecar: tuple[str, MLXBackend]
                                                            ) -> None:
    url, engine = engine_sidecar
    system = unique_system()
    for key in ("sk-acme", "sk-globex"):
        openai_client(url, key).chat.completions.create(
            model=TINY_MODEL, messages=chat(system, "Keep me."), max_tokens=2, temperature=0.0)
    disk = engine.engine.kv_disk
    assert disk.flush()

    def files(tenant: str) -> list[Path]:
        return [p for p in disk.root.rglob("*.safetensors") if not p.name.startswith(".")
                and json.loads(p.read_bytes()[8:8 + int.from_bytes(p.read_bytes()[:8],
                                                                   "little")])
                ["__metadata__"]["namespace"] == tenant]

    assert files("acme") and files("globex")
    with local_client(base_url=url) as http:
        r = http.post("/admin/purge", json={"tenant": "acme"},
                      headers=bearer(ENGINE_ADMIN))
    assert r.status_code == 200 and set(r.json()) == {"purged", "pattern"}
    assert files("acme") == [] and files("globex")
    assert "acme" not in engine.snapshot_stats().kv_store.by_namespace


def test_client_disconnect_cancels_the_engine_request(
        engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, engine = engine_sidecar
    cancelled = engine.snapshot_stats().cancelled
    sdk = openai_client(url, "sk-acme")
    with sdk.chat.completions.with_streaming_response.create(
        model=TINY_MODEL, messages=chat(unique_system(), "Go on forever."), max_tokens=30_000,
        temperature=0.0, stream=True,
    ) as response:
        stream = response.parse()
        next(iter(stream))
        next(iter(stream))
    # Leaving the block closed the connection: the sidecar cancels the engine request.
    assert wait_until(lambda: engine.snapshot_stats().cancelled > cancelled)
    assert wait_until(lambda: engine.snapshot_stats().active == 0)


def test_sidecar_refuses_bad_parameters_before_resolving(
        engine_sidecar: tuple[str, MLXBackend]) -> None:
    url, _ = engine_sidecar
    with pytest.raises(openai.BadRequestError, match="n > 1") as info:
        openai_client(url, "sk-acme").chat.completions.create(
            model=TINY_MODEL, messages=chat(unique_system(), "x"), n=2)
    assert info.value.body["code"] == "unsupported_parameter"


# -- (b) serve-engine: its own OpenAI-compatible server --------------------------------------


@pytest.fixture(scope="module")
def engine_server(tiny_model_dir: Path) -> Iterator[tuple[str, MLXBackend]]:
    chat_engine = MLXBackend.load(tiny_model_dir, name="tiny-engine")
    with ServerThread(create_engine_app(chat_engine, trust_namespace=True)) as url:
        yield url, chat_engine
    assert chat_engine.closed


def rendered(tokenizer: Any, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None = None) -> list[int]:
    return get_renderer(tokenizer, None, tools).render_ids(messages, tools, {})


def test_serve_engine_streams_given_ids_and_boundary(engine_server: tuple[str, MLXBackend],
                                                     tokenizer: Any) -> None:
    url, chat_engine = engine_server
    system = unique_system()
    ids = rendered(tokenizer, chat(system, "Hello."))
    n_static = len(rendered(tokenizer, [system])) // 2  # any boundary inside the prompt
    sdk = openai_client(url)
    usages = []
    for _ in range(2):
        stream = sdk.chat.completions.create(
            model="anything", messages=chat(system, "Hello."), max_tokens=4, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"specprefill_system_end": n_static, "prompt_token_ids": ids,
                        "specprefill_namespace": "t1"})
        chunks = list(stream)
        assert chunks[-1].usage is not None and not chunks[-1].choices
        assert chunks[-2].choices[0].finish_reason in ("length", "stop")
        usages.append(chunks[-1].usage)
    assert [u.prompt_tokens for u in usages] == [len(ids)] * 2
    # The same prompt again: the conversation store restores all of it but the last token
    # (more than the static n_static tokens the boundary alone would give).
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, len(ids) - 1]
    assert "t1" in chat_engine.snapshot_stats().kv_store.by_namespace


def test_serve_engine_renders_without_ids(engine_server: tuple[str, MLXBackend],
                                          tokenizer: Any) -> None:
    url, _ = engine_server
    messages, tools = chat(unique_system(), "Use a tool."), make_tools(2)
    completion = openai_client(url).chat.completions.create(
        model="tiny-engine", messages=messages, tools=tools, max_tokens=2, temperature=0.0)
    # The sidecar's render (the transformers convention) of the same body: the same prompt.
    assert completion.usage.prompt_tokens == len(rendered(tokenizer, messages, tools))
    assert completion.usage.prompt_tokens_details.cached_tokens == 0  # boundary 0
    assert completion.object == "chat.completion" and completion.model == "tiny-engine"


def prompt_tokens(url: str) -> dict[str, float]:
    """``prefix_cache_engine_prompt_tokens_total`` by kind (reused, computed) from /metrics."""
    with local_client(base_url=url) as http:
        text = http.get("/metrics").text
    return {s.labels["kind"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "prefix_cache_engine_prompt_tokens_total"}


def test_a_burst_sharing_a_cold_static_prefix_computes_it_once_over_http(
        engine_server: tuple[str, MLXBackend], tokenizer: Any) -> None:
    """Eight chats sent together with one ~1,600-token system + tools prefix and distinct
    questions: serve-engine renders them itself and cuts their boundary, so the first prefills
    the prefix and the other seven park on it and restore it (before: 0 reused)."""
    url, _ = engine_server
    system = {"role": "system", "content": unique_system()["content"] + " Rules: " + " ".join(
        f"rule {i} says keep the workspace tidy." for i in range(120))}
    tools = make_tools(8, seed=52)
    static = len(rendered(tokenizer, [system], tools))
    assert static > 1500
    before = prompt_tokens(url)
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-none", max_retries=0)

    async def burst() -> list[Any]:
        return await asyncio.gather(*(sdk.chat.completions.create(
            model="m", messages=chat(system, f"Question {i}: which file holds the {i}th key?"),
            tools=tools, max_tokens=1, temperature=0.0) for i in range(8)))

    answers = asyncio.run(burst())
    after = prompt_tokens(url)
    computed = after["computed"] - before["computed"]
    reused = after["reused"] - before["reused"]
    total = sum(a.usage.prompt_tokens for a in answers)
    assert computed + reused == total
    assert reused >= 7 * (static - 64), (computed, reused, static)  # the prefix, seven times
    assert computed <= total - 7 * (static - 64)
    assert sum(a.usage.prompt_tokens_details.cached_tokens for a in answers) == reused


@pytest.mark.parametrize("extra, code", [
    ({"prompt_token_ids": [1, 2, 3], "specprefill_system_end": 4}, "invalid_specprefill_system_end"),
    ({"prompt_token_ids": [1, 2, 3], "specprefill_system_end": -1},
     "invalid_specprefill_system_end"),
    ({"specprefill_system_end": 10_000}, "invalid_specprefill_system_end"),
    ({"prompt_token_ids": [1, -2]}, "invalid_prompt_token_ids"),
    ({"prompt_token_ids": [10**9]}, "invalid_prompt_token_ids"),
    ({"prompt_token_ids": "1 2 3"}, "invalid_prompt_token_ids"),
    ({"prompt_token_ids": [1, True, 3]}, "invalid_prompt_token_ids"),
    ({"specprefill_namespace": "no:colons"}, "invalid_specprefill_namespace"),
])
def test_serve_engine_bad_input_is_an_openai_400(engine_server: tuple[str, MLXBackend],
                                                 extra: dict[str, Any], code: str) -> None:
    url, _ = engine_server
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2,
            extra_body=extra)
    assert info.value.status_code == 400
    assert info.value.body["code"] == code and info.value.body["type"] == "invalid_request_error"
    assert info.value.body["message"]


def test_serve_engine_refuses_more_tokens_than_the_context(engine_server: tuple[str, MLXBackend],
                                                          ) -> None:
    url, chat_engine = engine_server
    window = chat_engine.context_length
    assert window == 32768                     # the tiny model's max_position_embeddings
    with pytest.raises(openai.BadRequestError,
                       match=f"maximum context length is {window} tokens") as info:
        openai_client(url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=window,
            extra_body={"prompt_token_ids": [1, 2, 3]})
    assert info.value.body["code"] == "context_length_exceeded"  # OpenAI's words and code
    assert f"(3 in the messages, {window} in the completion)" in info.value.body["message"]


def test_serve_engine_models_and_health(engine_server: tuple[str, MLXBackend]) -> None:
    url, _ = engine_server
    with local_client(base_url=url) as http:
        assert http.get("/health").json() == {"status": "ok"}
        models = http.get("/v1/models").json()
        bad = http.post("/v1/chat/completions", content=b"[1]",
                        headers={"content-type": "application/json"})
    assert [m["id"] for m in models["data"]] == ["tiny-engine"]
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "code"}


def test_serve_engine_takes_json_bodies_only_and_never_redirects(
        engine_server: tuple[str, MLXBackend]) -> None:
    url, _ = engine_server
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    with local_client(base_url=url) as http:
        for content_type in (None, "text/plain", "application/x-www-form-urlencoded"):
            headers = {"content-type": content_type} if content_type else {}
            r = http.post("/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = http.get("/v1/models/", headers={"host": "evil.example"})
        assert r.status_code == 404 and "location" not in r.headers


def test_serve_engine_api_key(engine_server: tuple[str, MLXBackend]) -> None:
    _, chat_engine = engine_server
    app = create_engine_app(chat_engine, api_key="sk-engine", close_engine=False)
    with ServerThread(app) as url:
        with pytest.raises(openai.AuthenticationError):
            openai_client(url, "sk-wrong").models.list()
        assert [m.id for m in openai_client(url, "sk-engine").models.list()] == ["tiny-engine"]
        with local_client(base_url=url) as http:
            for probe in ("/health", "/healthz", "/readyz"):   # the probes need no key
                assert http.get(probe).status_code == 200, probe
    assert not chat_engine.closed


def test_serve_engine_metrics_are_its_own_counters(engine_server: tuple[str, MLXBackend]) -> None:
    """``GET /metrics``: the engine's counters, what a pool's operator (and bench/routing.py)
    reads per replica; behind the engine's key when it has one."""
    url, chat_engine = engine_server

    def requests_total(text: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "prefix_cache_engine_requests_total")

    with local_client(base_url=url) as http:
        before = requests_total(http.get("/metrics").text)
        openai_client(url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1)
        after = http.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    assert requests_total(after.text) == before + 1
    assert requests_total(after.text) == chat_engine.snapshot_stats().requests
    # vLLM's load gauges and KV usage, under its names (the request finished: none running).
    load = {s.name: s.value for f in text_string_to_metric_families(after.text)
            for s in f.samples}
    assert load["prefix_cache_num_requests_running"] == 0
    assert load["prefix_cache_num_requests_waiting"] == 0
    assert 0 <= load["prefix_cache_kv_cache_usage_perc"] <= 1
    app = create_engine_app(chat_engine, api_key="sk-engine", close_engine=False)
    with ServerThread(app) as locked, local_client(base_url=locked) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers=bearer("sk-engine")).status_code == 200


def test_engine_options_reach_the_in_process_engine(tiny_model_dir: Path) -> None:
    app = engine_sidecar_app(tiny_model_dir, engine_options=[
        "kv_bytes=3MiB", "conversation_bytes=0", "max_context=4096", "specprefill_threshold=100",
        "kv_disk_bytes=0"])
    engine = app.state.service.models.get(TINY_MODEL).engine.engine
    try:
        assert engine.kv_store.max_bytes == 3 << 20 and engine.conversation_store is None
        assert engine.context_length == 4096 and engine.specprefill.threshold == 100
        assert engine.kv_disk is None
    finally:
        engine.close()


def test_serve_engine_command_exits_2_on_bad_engine_options(
        capsys: pytest.CaptureFixture[str]) -> None:
    from prefix_cache import cli

    assert cli.main(["serve-engine", "--model", "/no/such/folder",
                     "--engine-option", "kv_bites=1GiB"]) == 2
    assert "kv_bites" in capsys.readouterr().err


def test_serve_engine_command_exits_2_on_a_missing_folder(
        capsys: pytest.CaptureFixture[str]) -> None:
    from prefix_cache import cli

    assert cli.main(["serve-engine", "--model", "/no/such/folder"]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- (c) a sidecar in front of serve-engine (upstream kind specprefill) ------------------------


def test_sidecar_passes_the_boundary_to_serve_engine(engine_server: tuple[str, MLXBackend],
                                                     tokenizer: Any) -> None:
    engine_url, chat_engine = engine_server
    app = sidecar_app(served("tiny", tokenizer, Upstream(engine_url, "specprefill")),
                      api_keys=TENANT_KEYS)
    system, tools = unique_system(), make_tools(2)
    with ServerThread(app) as url:
        def stream(key: str, user: str) -> tuple[dict[str, str], list[Any]]:
            return streamed_chat(openai_client(url, key), model="tiny", messages=chat(system, user),
                                 tools=tools, max_tokens=3, temperature=0.0,
                                 stream_options={"include_usage": True})

        headers, chunks = stream("sk-acme", "One.")
        assert headers["x-prefix-cache"] == "miss" and chunks[-1].usage is not None
        before = chat_engine.snapshot_stats().reused_tokens
        headers, chunks = stream("sk-acme", "Two, longer.")
        end = int(headers["x-specprefill-system-end"])
        assert headers["x-prefix-cache"] == "hit" and end > 0
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == end
        assert chat_engine.snapshot_stats().reused_tokens - before == end
        assert any(c.choices and c.choices[0].delta.content for c in chunks)
        # The tenant travelled as specprefill_namespace: globex restores nothing of acme's.
        headers, chunks = stream("sk-globex", "Two, longer.")
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
        assert {"acme", "globex"} <= set(chat_engine.snapshot_stats().kv_store.by_namespace)

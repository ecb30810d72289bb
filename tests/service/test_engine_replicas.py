"""A real ``serve-engine`` replica (the tiny model, its KV disk tier on, namespaces trusted,
an API key) behind a real sidecar with tenants: a tenant's purge reaches the replica (RAM, disk,
stored responses), and a client never sets a field the sidecar owns, whatever the upstream's
kind. Clients are the real OpenAI SDK on loopback; the tiny model's text is never checked."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

from engine_adapter.backend import MLXBackend  # noqa: E402
from engine_adapter.options import EngineOptions  # noqa: E402
from engine_adapter.server import create_engine_app  # noqa: E402
from prefix_cache.cache.keys import model_label  # noqa: E402
from prefix_cache.engine import protocol as wire  # noqa: E402
from prefix_cache.model_folders.model_dir import load_tokenizer  # noqa: E402
from prefix_cache.service.pool import UpstreamPool  # noqa: E402
from prefix_cache.service.served_models import ServedModel  # noqa: E402
from prefix_cache.service.upstream import Upstream  # noqa: E402
from tests.support.loopback import free_port, local_client, openai_client  # noqa: E402
from tests.support.recording_upstream import Recorder  # noqa: E402
from tests.support.server_thread import ServerThread  # noqa: E402
from tests.support.sidecar import TENANT_KEYS, bearer, served, sidecar_app, unique_system  # noqa: E402
from tests.support.tools import make_tools  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

ENGINE_KEY, ADMIN_KEY = "sk-engine", "sk-admin"
MODEL = "tiny"


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[tuple[str, MLXBackend]]:
    """``serve-engine --trust-namespace --api-key`` on the tiny model, its disk tier in a
    folder of its own: its URL and its backend."""
    kv_dir = tmp_path_factory.mktemp("replica-kv")
    options = EngineOptions.parse({"kv_disk_dir": str(kv_dir)}).engine_kwargs()
    chat = MLXBackend.load(tiny_model_dir, name="tiny-replica", **options)
    with ServerThread(create_engine_app(chat, trust_namespace=True, api_key=ENGINE_KEY)) as url:
        yield url, chat


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def sidecar(replica: tuple[str, MLXBackend], tokenizer: Any) -> Iterator[str]:
    upstream = Upstream(replica[0], "specprefill", api_key=ENGINE_KEY)
    app = sidecar_app(served(MODEL, tokenizer, upstream), api_keys=TENANT_KEYS,
                      admin_keys=[ADMIN_KEY])
    with ServerThread(app) as url:
        yield url


def ask(url: str, key: str, system: dict[str, str], user: str, **extra: Any) -> Any:
    """One chat completion through the sidecar; its usage."""
    return openai_client(url, key).chat.completions.create(
        model=MODEL, messages=[system, {"role": "user", "content": user}], tools=make_tools(3),
        max_tokens=2, temperature=0.0, extra_body=extra or None).usage


def cached(usage: Any) -> int:
    return usage.prompt_tokens_details.cached_tokens


def disk_namespaces(chat: MLXBackend) -> set[str]:
    """The namespaces of the replica's KV files on disk (read from each file's header)."""
    disk = chat.engine.kv_disk
    assert disk.flush()
    names = set()
    for path in disk.root.rglob("*.safetensors"):
        data = path.read_bytes()
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        names.add(header["__metadata__"]["namespace"])
    return names


# -- 1. a purge reaches every engine replica ------------------------------------------------


def test_a_tenants_purge_reaches_the_serve_engine_replica(sidecar: str,
                                                          replica: tuple[str, MLXBackend]) -> None:
    _, chat = replica
    system = unique_system()
    ask(sidecar, "sk-acme", system, "First.")
    assert cached(ask(sidecar, "sk-acme", system, "Second.")) > 0  # acme's KV is kept
    ask(sidecar, "sk-globex", system, "First.")
    assert {"acme", "globex"} <= disk_namespaces(chat)
    assert {"acme", "globex"} <= set(chat.snapshot_stats().kv_store.by_namespace)
    with local_client(base_url=sidecar) as http:
        r = http.post("/admin/purge", json={"tenant": "acme"}, headers=bearer(ADMIN_KEY))
    assert r.status_code == 200, r.text
    # Nothing of acme's is left on the replica, in RAM or on disk; globex's is untouched.
    assert "acme" not in disk_namespaces(chat) and "globex" in disk_namespaces(chat)
    assert "acme" not in chat.snapshot_stats().kv_store.by_namespace
    assert cached(ask(sidecar, "sk-acme", system, "Third.")) == 0
    assert cached(ask(sidecar, "sk-globex", system, "Second.")) > 0


def test_a_purge_stops_what_is_in_flight(sidecar: str, replica: tuple[str, MLXBackend]) -> None:
    """Issue 47, defect 2: acme's stream is still running when its purge answers; what that
    request stores after (its prompt's and reply's KV, in RAM and through the disk writer) is
    refused, so acme's next turn reuses nothing and no file of acme's comes back."""
    _, chat = replica
    system = unique_system()
    messages = [system, {"role": "user", "content": "A long answer, please."}]
    stream = openai_client(sidecar, "sk-acme").chat.completions.create(
        model=MODEL, messages=messages, max_tokens=256, temperature=0.0, stream=True,
        stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)  # the engine runs it now
    with local_client(base_url=sidecar) as http:
        r = http.post("/admin/purge", json={"tenant": "acme"}, headers=bearer(ADMIN_KEY))
    running = chat.snapshot_stats().active
    assert r.status_code == 200, r.text
    generated = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert running == 1 and generated and generated[-1] > 1  # purged mid-request
    # The engine stores a finished request's KV after its last token is out: another
    # tenant's answer says the engine thread is past that (one thread, in order).
    ask(sidecar, "sk-globex", unique_system(), "After.")
    assert "acme" not in disk_namespaces(chat)   # the writer's queue drained first
    assert "acme" not in chat.snapshot_stats().kv_store.by_namespace
    assert "acme" not in chat.snapshot_stats().conversation_store.by_namespace
    again = openai_client(sidecar, "sk-acme").chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, temperature=0.0)
    assert cached(again.usage) == 0


def test_the_replicas_purge_needs_its_api_key(replica: tuple[str, MLXBackend]) -> None:
    url, _ = replica
    with local_client(base_url=url) as http:
        anonymous = http.post(wire.PURGE_PATH, json={wire.PURGE_NAMESPACE: "acme"})
        wrong = http.post(wire.PURGE_PATH, json={wire.PURGE_NAMESPACE: "acme"},
                          headers=bearer("sk-wrong"))
        bad = http.post(wire.PURGE_PATH, json={wire.PURGE_NAMESPACE: "a*"},
                        headers=bearer(ENGINE_KEY))
    assert anonymous.status_code == wrong.status_code == 401
    assert bad.status_code == 400 and "namespace" in bad.json()["error"]["message"]


def test_a_purge_that_misses_a_replica_is_a_503(replica: tuple[str, MLXBackend],
                                                tokenizer: Any) -> None:
    """A replica that is down keeps its disk files: the operator is told to retry."""
    live = Upstream(replica[0], "specprefill", api_key=ENGINE_KEY)
    dead = Upstream(f"http://127.0.0.1:{free_port()}", "specprefill", api_key=ENGINE_KEY)
    model = ServedModel(MODEL, model_label(MODEL), tokenizer, live,
                        pool=UpstreamPool([live, dead]))
    app = sidecar_app(model, api_keys=TENANT_KEYS, admin_keys=[ADMIN_KEY])
    with ServerThread(app) as url, local_client(base_url=url) as http:
        r = http.post("/admin/purge", json={"tenant": "acme"}, headers=bearer(ADMIN_KEY))
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "upstream_purge_incomplete"
    assert "1 of 2" in r.json()["error"]["message"]


# -- 2. fields the sidecar owns never come from a client --------------------------------------


@pytest.mark.parametrize("kind", ["openai", "specprefill"])
def test_a_client_cannot_name_another_tenants_namespace(sidecar: str,
                                                        replica: tuple[str, MLXBackend],
                                                        tokenizer: Any, kind: str) -> None:
    """acme's KV is on the replica under its namespace; globex, through a sidecar whose
    upstream is of ``kind``, names that namespace (and sends a boundary) to the replica, which
    trusts the namespace it is sent: it reuses nothing of acme's."""
    system = unique_system()
    ask(sidecar, "sk-acme", system, "First.")
    assert cached(ask(sidecar, "sk-acme", system, "Second.")) > 0
    upstream = Upstream(replica[0], kind, api_key=ENGINE_KEY)  # type: ignore[arg-type]
    app = sidecar_app(served(MODEL, tokenizer, upstream), api_keys=TENANT_KEYS)
    with ServerThread(app) as url:
        forged = ask(url, "sk-globex", system, "Second.",
                     **{wire.SPECPREFILL_NAMESPACE: "acme", wire.SPECPREFILL_SYSTEM_END: 5,
                        "specprefill_future_field": 1})
    assert cached(forged) == 0


@pytest.mark.parametrize("kind", ["openai", "specprefill"])
def test_owned_fields_are_removed_before_any_upstream(recorder_server: tuple[Recorder, str],
                                                      tokenizer: Any, kind: str) -> None:
    rec, upstream_url = recorder_server
    rec.reset()
    app = sidecar_app(served(MODEL, tokenizer, Upstream(upstream_url, kind)),  # type: ignore[arg-type]
                      api_keys=TENANT_KEYS)
    forged = {wire.SPECPREFILL_NAMESPACE: "acme", wire.PROMPT_TOKEN_IDS: [1, 2, 3],
              wire.SPECPREFILL_SYSTEM_END: 2, "specprefill_anything": True}
    body = {"model": MODEL, "messages": [unique_system(), {"role": "user", "content": "Hi"}],
            "max_tokens": 2, wire.SPECPREFILL_KEEP_PCT: 0.5, **forged}
    with ServerThread(app) as url, local_client(base_url=url) as http:
        r = http.post("/v1/chat/completions", json=body, headers=bearer("sk-globex"))
    assert r.status_code == 200, r.text
    sent = rec.last.body
    assert sent[wire.SPECPREFILL_KEEP_PCT] == 0.5  # the client's own SpecPrefill knob stays
    assert "specprefill_anything" not in sent
    if kind == "openai":
        assert not set(forged) & set(sent)
    else:  # the sidecar's own values, never the client's
        assert sent[wire.SPECPREFILL_NAMESPACE] == "globex"
        assert sent[wire.PROMPT_TOKEN_IDS] != [1, 2, 3]
        assert sent[wire.SPECPREFILL_SYSTEM_END] > 2


# -- 3. grammars: one tenant's never another's, compiled off the loop, refused before they run -


def schema_format(properties: int, *, required: bool = False, tag: str = "") -> dict[str, Any]:
    """A ``response_format`` of an object with ``properties`` string properties (names carry
    ``tag``, so each test's schema is its own)."""
    names = [f"{tag}p{i}" for i in range(properties)]
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False,
                              "properties": {n: {"type": "string"} for n in names}}
    if required:
        schema["required"] = names
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def post_chat(url: str, key: str, max_tokens: int = 2, **extra: Any) -> Any:
    """A chat completion through the sidecar with httpx (its status and error body, as sent)."""
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [unique_system(), {"role": "user", "content": "JSON, please."}], **extra}
    with local_client(base_url=url, timeout=120.0) as http:
        return http.post("/v1/chat/completions", json=body, headers=bearer(key))


def test_a_tenant_never_gets_another_tenants_compiled_grammar(
        sidecar: str, replica: tuple[str, MLXBackend]) -> None:
    """Issue 47, defect 3: globex sending the schema acme sent compiles it anew (no timing
    tells it what acme sent), and acme's purge drops acme's compiled grammars."""
    grammars = replica[1].grammars
    fmt = schema_format(6, required=True, tag=uuid.uuid4().hex[:8])
    counts = []
    for key in ("sk-acme", "sk-acme", "sk-globex", "sk-globex"):
        assert post_chat(sidecar, key, response_format=fmt).status_code == 200
        counts.append(grammars.compiles)
    assert [b - a for a, b in zip(counts, counts[1:])] == [0, 1, 0]  # per tenant, then hits
    with local_client(base_url=sidecar) as http:
        assert http.post("/admin/purge", json={"tenant": "acme"},
                         headers=bearer(ADMIN_KEY)).status_code == 200
    assert post_chat(sidecar, "sk-acme", response_format=fmt).status_code == 200
    assert grammars.compiles == counts[-1] + 1   # acme's was purged
    assert post_chat(sidecar, "sk-globex", response_format=fmt).status_code == 200
    assert grammars.compiles == counts[-1] + 1   # globex's was not


def test_a_slow_grammar_stalls_nobody_and_an_oversize_one_is_a_400(
        sidecar: str, replica: tuple[str, MLXBackend]) -> None:
    """Issue 47, defect 4: while acme's schema of 2,500 optional properties compiles (seconds),
    the replica's /health and globex's chat are answered; a schema past the grammar size limit
    is a 400 naming the limit, compiled never."""
    url, chat = replica
    slow: list[Any] = []
    thread = threading.Thread(target=lambda: slow.append(post_chat(
        sidecar, "sk-acme", response_format=schema_format(2500, tag="slow"))))
    thread.start()
    try:
        wait_until(lambda: chat.grammars.compiling == 1, "the slow schema compiling")
        with local_client(base_url=url) as http:
            assert http.get("/health").status_code == 200
        assert post_chat(sidecar, "sk-globex").status_code == 200
        assert chat.grammars.compiling == 1   # both answered while it compiled
    finally:
        thread.join(timeout=300)
    assert slow[0].status_code == 400   # and it cannot run (defect 5): refused, not a 500
    before = chat.grammars.compiles
    big = post_chat(sidecar, "sk-acme", response_format=schema_format(5000, required=True))
    assert big.status_code == 400, big.text
    error = big.json()["error"]
    assert error["code"] == "grammar_too_large" and "131072 bytes" in error["message"]
    assert chat.grammars.compiles == before


def test_a_grammar_that_cannot_run_is_a_400_sent_to_one_replica(
        replica: tuple[str, MLXBackend], tokenizer: Any) -> None:
    """Issue 47, defect 5: 1,500 optional properties compile, then fail at the first token;
    that is found at compile time, a 400 naming the limit, and a 400 is never retried on the
    other replica (two servers of one engine here: one compile, not two)."""
    url, chat = replica
    with ServerThread(create_engine_app(chat, trust_namespace=True, api_key=ENGINE_KEY)) as second:
        replicas = [Upstream(u, "specprefill", api_key=ENGINE_KEY) for u in (url, second)]
        model = ServedModel(MODEL, model_label(MODEL), tokenizer, replicas[0],
                            pool=UpstreamPool(replicas))
        app = sidecar_app(model, api_keys=TENANT_KEYS)
        with ServerThread(app) as sidecar_url:
            before = chat.grammars.compiles
            r = post_chat(sidecar_url, "sk-acme",
                          response_format=schema_format(1500, tag=uuid.uuid4().hex[:8]))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "grammar_cannot_run"
            assert "max is 2000" in r.json()["error"]["message"]
            assert chat.grammars.compiles == before + 1
            assert post_chat(sidecar_url, "sk-acme").status_code == 200  # no replica ejected

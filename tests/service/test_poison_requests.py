"""Poison requests: numbers out of range are 400s naming the field (on the sidecar, on
``serve-engine`` and in the in-process engine), and a request that every replica answers with a
5xx ejects none of them. Three real ``serve-engine`` replicas (the tiny model) behind a real
sidecar; a fault wrapper makes a replica answer 500 to a marked request, or to everything."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.responses import JSONResponse

pytest.importorskip("mlx_lm")

from engine_adapter.backend import MLXBackend  # noqa: E402
from engine_adapter.server import create_engine_app  # noqa: E402
from prefix_cache.cache.keys import model_label  # noqa: E402
from prefix_cache.engine.protocol import BackendRequest, SamplingParams  # noqa: E402
from prefix_cache.errors import InvalidRequestError  # noqa: E402
from prefix_cache.model_folders.model_dir import load_tokenizer  # noqa: E402
from prefix_cache.service.pool import UpstreamPool  # noqa: E402
from prefix_cache.service.served_models import ServedModel  # noqa: E402
from prefix_cache.service.upstream import Upstream  # noqa: E402
from tests.support.loopback import local_client  # noqa: E402
from tests.support.server_thread import ServerThread  # noqa: E402
from tests.support.sidecar import TENANT_KEYS, bearer, sidecar_app, unique_system  # noqa: E402

MODEL = "tiny"
REPLICAS = 3
POISON = "poison_marker"  # a field the fault wrapper answers 500 to


class Faults:
    """An ASGI wrapper of a real replica: a 500 to every request whose body names ``POISON``,
    or to every POST while ``broken``."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.broken = False
        self.seen = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        self.seen += 1
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if self.broken or POISON.encode() in body:
            error = {"error": {"message": "boom", "type": "server_error", "code": "boom"}}
            await JSONResponse(error, status_code=500)(scope, receive, send)
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


@dataclass
class Replica:
    url: str
    faults: Faults
    chat: MLXBackend


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path) -> Iterator[list[Replica]]:
    made, servers = [], []
    for i in range(REPLICAS):
        chat = MLXBackend.load(tiny_model_dir, name=f"tiny-{i}", kv_disk_bytes=0)
        faults = Faults(create_engine_app(chat, trust_namespace=True))
        server = ServerThread(faults, log_level="critical")
        made.append(Replica(server.__enter__(), faults, chat))
        servers.append(server)
    yield made
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def sidecar(replicas: list[Replica], tiny_model_dir: Path) -> Iterator[tuple[str, UpstreamPool]]:
    for r in replicas:
        r.faults.broken, r.faults.seen = False, 0
    upstreams = [Upstream(r.url, "specprefill") for r in replicas]
    pool = UpstreamPool(upstreams, eject_s=30.0)
    model = ServedModel(MODEL, model_label(MODEL), load_tokenizer(tiny_model_dir), upstreams[0],
                        pool=pool)
    with ServerThread(sidecar_app(model, api_keys=TENANT_KEYS), log_level="critical") as url:
        yield url, pool


def body(system: dict[str, str], user: str = "Hi.", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [system, {"role": "user", "content": user}],
            "max_tokens": 2, "temperature": 0.0, **extra}


def ejections(pool: UpstreamPool) -> list[int]:
    return [row["ejections"] for row in pool.snapshot()]


OUT_OF_RANGE = [("seed", 2**64), ("seed", 10**30), ("max_tokens", 0), ("max_tokens", 2**40),
                ("max_completion_tokens", -3), ("temperature", 2.5), ("top_p", 1.5),
                ("n", 0), ("n", 10**6), ("presence_penalty", 9.0), ("frequency_penalty", -3.0),
                ("top_logprobs", 21), ("logprobs", "yes"), ("specprefill_keep_pct", 2.0),
                ("specprefill_threshold", -1)]


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_a_number_out_of_range_is_a_400_naming_it_before_any_replica(
        sidecar: tuple[str, UpstreamPool], replicas: list[Replica], field: str,
        value: Any) -> None:
    url, pool = sidecar
    with local_client(base_url=url) as http:
        r = http.post("/v1/chat/completions", headers=bearer("sk-acme"),
                      json=body(unique_system(), **{field: value}))
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert sum(f.faults.seen for f in replicas) == 0 and ejections(pool) == [0] * REPLICAS


@pytest.mark.parametrize(("field", "value"), [("seed", 2**64), ("seed", -1), ("top_p", 0.0),
                                              ("max_tokens", 0), ("temperature", 2.5)])
def test_serve_engine_refuses_the_same_numbers_with_a_400(replicas: list[Replica], field: str,
                                                          value: Any) -> None:
    with local_client(base_url=replicas[0].url) as http:
        r = http.post("/v1/chat/completions", json=body(unique_system(), **{field: value}))
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_the_largest_seed_runs(replicas: list[Replica]) -> None:
    with local_client(base_url=replicas[0].url) as http:
        r = http.post("/v1/chat/completions", json=body(unique_system(), seed=2**64 - 1,
                                                        temperature=0.7))
    assert r.status_code == 200, r.text


def test_the_in_process_engine_refuses_a_seed_past_64_bits(replicas: list[Replica]) -> None:
    chat = replicas[0].chat
    ids = chat.tokenizer.encode("Hello there")
    with pytest.raises(InvalidRequestError, match="seed"):
        chat.check(BackendRequest(ids, sampling=SamplingParams(max_tokens=2, seed=2**64)))
    chat.check(BackendRequest(ids, sampling=SamplingParams(max_tokens=2, seed=2**64 - 1)))


def test_a_poison_request_ejects_no_replica(sidecar: tuple[str, UpstreamPool],
                                            replicas: list[Replica]) -> None:
    """The request fails on its replica and on the retry: it is the request's fault, so every
    replica stays in routing and another tenant's turns still find their KV."""
    url, pool = sidecar
    system = unique_system()
    with local_client(base_url=url) as http:
        def ask(key: str, **extra: Any) -> Any:
            return http.post("/v1/chat/completions", json=body(system, uuid.uuid4().hex, **extra),
                             headers=bearer(key))

        assert ask("sk-globex").status_code == 200
        warm = ask("sk-globex").json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        poisoned = ask("sk-acme", **{POISON: True})
        after = ask("sk-globex").json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert poisoned.status_code == 500
    assert sum(r.faults.seen for r in replicas) == 5  # 2 + the poison twice (a retry) + 1
    assert ejections(pool) == [0] * REPLICAS
    # >=: the random user texts may share a first token with an earlier turn's (one more)
    assert warm > 0 and after >= warm


def test_a_replica_that_fails_alone_is_still_ejected(sidecar: tuple[str, UpstreamPool],
                                                     replicas: list[Replica]) -> None:
    url, pool = sidecar
    replicas[1].faults.broken = True
    with local_client(base_url=url) as http:
        for _ in range(30):  # agents of their own: one in 3 is routed to the broken one first
            r = http.post("/v1/chat/completions", json=body(unique_system()),
                          headers=bearer("sk-acme"))
            assert r.status_code == 200, r.text
            if ejections(pool)[1]:
                break
    assert ejections(pool) == [0, 1, 0], (pool.snapshot(), [f.faults.seen for f in replicas])

"""Both servers refuse a bad body the same way: the sidecar (``serve --engine mlx``) and
``serve-engine`` mount the same routes, and every body is checked by the same code whichever
host is below (``api.pipeline.admit``, then the API's parser), so the status, the error's type,
code and message are equal, byte for byte, for chat completions, Messages and Responses.

The client is httpx against both apps on real uvicorn; the model is the tiny random-weights one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")

from engine_adapter.backend import MLXBackend  # noqa: E402
from engine_adapter.server import create_engine_app  # noqa: E402
from tests.support.loopback import local_client  # noqa: E402
from tests.support.server_thread import ServerThread  # noqa: E402
from tests.support.service_fixtures import TINY_MODEL  # noqa: E402
from tests.support.sidecar import engine_sidecar_app  # noqa: E402

NO_DISK = {"kv_disk_bytes": 0}
USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": TINY_MODEL, "messages": USER, "max_tokens": 2}
MESSAGES = {"model": TINY_MODEL, "messages": USER, "max_tokens": 2}
RESPONSES = {"model": TINY_MODEL, "input": "hi", "max_output_tokens": 2}
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (path, body, a word the error's message must hold: the field to blame)
BAD_BODIES: list[tuple[str, Any, str]] = [
    # chat completions
    ("/v1/chat/completions", [1, 2], "object"),
    ("/v1/chat/completions", "hello", "object"),
    ("/v1/chat/completions", {"model": TINY_MODEL}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": ["hi"]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     "wizard"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, "role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {**CHAT, "model": 5}, "model"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "tools": "x"}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [5]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "response_format": "json"}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "bogus"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "tools": [FN], "tool_choice": "sometimes"},
     "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "temperature": 5}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 2}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "seed": 1.5}, "seed"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, "n > 1"),
    ("/v1/chat/completions", {**CHAT, "stop": [1]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "specprefill_keep_pct": 7}, "specprefill_keep_pct"),
    # Anthropic Messages
    ("/v1/messages", [1], "object"),
    ("/v1/messages", {"model": TINY_MODEL, "max_tokens": 2}, "messages"),
    ("/v1/messages", {**MESSAGES, "messages": "x"}, "messages"),
    ("/v1/messages", {**MESSAGES, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/messages", {**MESSAGES, "system": 5}, "system"),
    ("/v1/messages", {**MESSAGES, "tools": [{"name": 5}]}, "tools"),
    ("/v1/messages", {**MESSAGES, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ("/v1/messages", {**MESSAGES, "temperature": 9}, "temperature"),
    ("/v1/messages", {**MESSAGES, "max_tokens": "a"}, "max_tokens"),
    ("/v1/messages", {**MESSAGES, "output_config": {"format": {"type": "bogus"}}},
     "output_config"),
    # OpenAI Responses
    ("/v1/responses", [1], "object"),
    ("/v1/responses", {"model": TINY_MODEL}, "input"),
    ("/v1/responses", {**RESPONSES, "input": 5}, "input"),
    ("/v1/responses", {**RESPONSES, "input": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/responses", {**RESPONSES, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/responses", {**RESPONSES, "temperature": 9}, "temperature"),
    ("/v1/responses", {**RESPONSES, "max_output_tokens": -3}, "max_output_tokens"),
    ("/v1/responses", {**RESPONSES, "text": {"format": {"type": "bogus"}}}, "text"),
    ("/v1/responses", {**RESPONSES, "previous_response_id": "resp_unknown"},
     "resp_unknown"),
]


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    """The sidecar on the in-process engine and serve-engine, both on the tiny model (open: no
    keys), their base URLs."""
    sidecar = engine_sidecar_app(tiny_model_dir, engine_options=NO_DISK)
    engine = create_engine_app(MLXBackend.load(tiny_model_dir, **NO_DISK))
    with ServerThread(sidecar) as sidecar_url, ServerThread(engine) as engine_url:
        yield sidecar_url, engine_url


@pytest.mark.parametrize("path, body, names", BAD_BODIES,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, _, _) in
                              enumerate(BAD_BODIES)])
def test_a_bad_body_gets_the_same_400_from_both_servers(servers: tuple[str, str], path: str,
                                                        body: Any, names: str) -> None:
    answers = []
    with local_client() as http:
        for url in servers:
            r = http.post(url + path, json=body)
            answers.append((r.status_code, r.json()))
    (status, error), engine_answer = answers
    assert (status, error) == engine_answer
    assert status == 400
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        message = error["error"]["message"]
    else:
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"]
        message = error["error"]["message"]
    assert names in message


def test_malformed_json_gets_the_same_400_from_both_servers(servers: tuple[str, str]) -> None:
    answers = []
    with local_client() as http:
        for url in servers:
            for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
                r = http.post(url + path, content=b'{"messages": [', headers={
                    "content-type": "application/json"})
                answers.append((path, r.status_code, r.json()))
    assert answers[:3] == answers[3:]
    assert {status for _, status, _ in answers} == {400}


def test_both_servers_prepare_the_same_prompt(servers: tuple[str, str]) -> None:
    """The sidecar's prompt comes from its cache (a verdict, a key, a boundary in the headers);
    serve-engine renders the same conversation itself: the same prompt length, no cache."""
    body = {"model": TINY_MODEL, "system": f"You are agent {uuid.uuid4().hex}.",
            "tools": [{"name": "read", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "Count my tokens."}]}
    with local_client() as http:
        sidecar, engine = (http.post(url + "/v1/messages/count_tokens", json=body)
                           for url in servers)
        again = http.post(servers[0] + "/v1/messages/count_tokens", json=body)
    assert sidecar.status_code == engine.status_code == again.status_code == 200
    assert sidecar.json() == engine.json() == again.json()
    assert sidecar.json()["input_tokens"] > 0
    assert [r.headers["x-prefix-cache"] for r in (sidecar, again)] == ["miss", "hit"]
    assert 0 < int(again.headers["x-specprefill-system-end"]) < sidecar.json()["input_tokens"]
    assert "x-prefix-cache" not in engine.headers

"""The sidecar's OpenAI-compatible surface on a real uvicorn, with the OpenAI SDK as the client
and a recording upstream that shows exactly what was forwarded."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from prefix_cache.model_folders.demo import DEMO_TEMPLATE
from prefix_cache.service.upstream import Upstream
from tests.support import reference
from tests.support.loopback import free_port, openai_client
from tests.support.recording_upstream import Recorder
from tests.support.sidecar import served, sidecar_app, unique_system
from tests.support.tools import make_tools

openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

BODY_LIMIT = 256 * 1024
STRICT_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'user' and 'FORBIDDEN' in m.content %}"
    "{{- raise_exception('the user turn may not say FORBIDDEN') }}{%- endif %}{%- endfor %}"
    + DEMO_TEMPLATE
)


@pytest.fixture(scope="module")
def strict_tokenizer(demo_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from prefix_cache.model_folders.model_dir import load_tokenizer

    path = tmp_path_factory.mktemp("strict") / "strict.jinja"
    path.write_text(STRICT_TEMPLATE)
    return load_tokenizer(demo_folder, path)


@pytest.fixture(scope="module")
def app(recorder_server: tuple[Recorder, str], demo_tokenizer: Any, strict_tokenizer: Any) -> Any:
    url = recorder_server[1]
    return sidecar_app(
        served("rec", demo_tokenizer, Upstream(url)),
        served("rec-spec", demo_tokenizer, Upstream(url, "specprefill")),
        served("rec-renamed", demo_tokenizer, Upstream(url, model="upstream-name")),
        served("boundary-only", demo_tokenizer),
        served("strict", strict_tokenizer, Upstream(url)),
        served("dead", demo_tokenizer, Upstream(f"http://127.0.0.1:{free_port()}")),
        max_body_bytes=BODY_LIMIT, ready_timeout_s=1.0)


@pytest.fixture
def sdk(base: str) -> Any:
    return openai_client(base)


def chat(system: dict[str, str] | None = None, user: Any = "Deploy the service.",
         tools: int = 3, **extra: Any) -> dict[str, Any]:
    messages = ([system] if system else []) + [{"role": "user", "content": user}]
    return {"model": "rec", "messages": messages, "tools": make_tools(tools), **extra}


def entries(app: Any) -> int:
    return int(app.state.service.store.stats().memory.entries)


# -- POST /v1/prefix/boundary ---------------------------------------------------------------


def test_boundary_miss_then_hit_matches_reference(http: Any, demo_tokenizer: Any) -> None:
    body = chat(unique_system())
    first = http.post("/v1/prefix/boundary", json=body)
    second = http.post("/v1/prefix/boundary", json={**body, "return_prompt_ids": True})
    assert first.status_code == second.status_code == 200
    a, b = first.json(), second.json()
    assert set(a) == {"specprefill_system_end", "prompt_tokens", "cache", "key"}
    assert (a["cache"], b["cache"]) == ("miss", "hit")
    assert first.headers["x-prefix-cache"] == "miss" and second.headers["x-prefix-cache"] == "hit"
    assert a["key"] == b["key"] and a["key"].startswith("spc:default:rec:")
    expected = reference.two_probe(demo_tokenizer, body["messages"], body["tools"])
    prompt = reference.render(demo_tokenizer, body["messages"], body["tools"], None, None)
    assert a["specprefill_system_end"] == b["specprefill_system_end"] == expected > 0
    assert first.headers["x-specprefill-system-end"] == str(expected)
    assert a["prompt_tokens"] == len(prompt) and b["prompt_ids"] == list(prompt)


def test_boundary_without_system_is_none(http: Any) -> None:
    r = http.post("/v1/prefix/boundary", json=chat(None))
    assert r.status_code == 200
    assert r.json() | {"prompt_tokens": 0} == {
        "specprefill_system_end": 0, "prompt_tokens": 0, "cache": "none", "key": ""}


def test_client_sent_namespace_is_ignored(http: Any) -> None:
    body = chat(unique_system(), namespace="victim", tenant="victim")
    key = http.post("/v1/prefix/boundary", json=body).json()["key"]
    assert key.split(":")[1] == "default"


def test_image_parts_in_the_user_turn_do_not_change_the_key(http: Any) -> None:
    system = unique_system()
    text = http.post("/v1/prefix/boundary", json=chat(system, "What is in the picture?")).json()
    parts = [{"type": "text", "text": "What is in the picture?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    image = http.post("/v1/prefix/boundary", json=chat(system, parts)).json()
    assert (text["cache"], image["cache"]) == ("miss", "hit")
    assert image["key"] == text["key"]
    assert image["specprefill_system_end"] == text["specprefill_system_end"]


def test_model_picks_the_tokenizer_and_the_key_label(http: Any) -> None:
    body = chat(unique_system())
    default = http.post("/v1/prefix/boundary", json={k: v for k, v in body.items() if k != "model"})
    named = http.post("/v1/prefix/boundary", json={**body, "model": "boundary-only"})
    assert default.json()["key"].split(":")[2] == "rec"  # the first model is the default
    assert named.json()["key"].split(":")[2] == "boundary-only"
    assert named.json()["cache"] == "miss"  # another model never shares an entry


# -- POST /v1/chat/completions: what is forwarded, per upstream kind --------------------------


def test_openai_kind_forwards_the_body_byte_for_byte(http: Any, recorder: Recorder) -> None:
    body = chat(unique_system(), top_k=5, x_vendor={"b": 1, "a": [1.50, 2e3]})
    raw = json.dumps(body, indent=1).encode()  # odd spacing and number spellings survive too
    r = http.post("/v1/chat/completions", content=raw,
                  headers={"content-type": "application/json",
                           "authorization": "Bearer sk-client-secret"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "recorded"
    assert recorder.last.raw == raw
    assert "sk-client-secret" not in json.dumps(recorder.last.headers)  # never passed on
    boundary = http.post("/v1/prefix/boundary", json=body).json()
    assert r.headers["x-prefix-cache"] == "miss" and boundary["cache"] == "hit"
    assert r.headers["x-specprefill-system-end"] == str(boundary["specprefill_system_end"])


def test_sdk_chat_through_openai_kind(sdk: Any, recorder: Recorder) -> None:
    system = unique_system()
    tools = make_tools(2)
    raw = sdk.chat.completions.with_raw_response.create(
        model="rec", messages=[system, {"role": "user", "content": "Hi"}], tools=tools,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "top_k": 3})
    completion = raw.parse()
    assert completion.choices[0].message.content == "recorded"
    assert raw.headers["x-prefix-cache"] == "miss" and int(raw.headers["x-specprefill-system-end"]) > 0
    forwarded = recorder.last.body
    assert forwarded["messages"] == [system, {"role": "user", "content": "Hi"}]
    assert forwarded["tools"] == tools and forwarded["top_k"] == 3
    assert forwarded["chat_template_kwargs"] == {"enable_thinking": False}
    assert "specprefill_system_end" not in forwarded and "prompt_token_ids" not in forwarded
    again = sdk.chat.completions.with_raw_response.create(
        model="rec", messages=[system, {"role": "user", "content": "Another turn"}], tools=tools,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert again.headers["x-prefix-cache"] == "hit"


def test_specprefill_kind_attaches_boundary_and_prompt_ids(sdk: Any, http: Any,
                                                           recorder: Recorder) -> None:
    system = unique_system()
    messages = [system, {"role": "user", "content": "Summarize the repo."}]
    tools = make_tools(4)
    raw = sdk.chat.completions.with_raw_response.create(model="rec-spec", messages=messages,
                                                        tools=tools, temperature=0.5)
    forwarded = recorder.last.body
    boundary = http.post("/v1/prefix/boundary", json={
        "model": "rec-spec", "messages": messages, "tools": tools, "return_prompt_ids": True}).json()
    assert boundary["cache"] == "hit"
    sent_by_client = {"messages": messages, "model": "rec-spec", "temperature": 0.5, "tools": tools}
    assert forwarded == {**sent_by_client,
                         "specprefill_system_end": boundary["specprefill_system_end"],
                         "prompt_token_ids": boundary["prompt_ids"],
                         "specprefill_namespace": "default"}
    assert list(forwarded)[-3:] == ["specprefill_system_end", "prompt_token_ids",
                                    "specprefill_namespace"]
    assert raw.headers["x-specprefill-system-end"] == str(boundary["specprefill_system_end"])


def test_integers_beyond_64_bits_stay_exact(http: Any, recorder: Recorder) -> None:
    """A template renders 2**70 digit for digit: the sidecar keys it exactly (not as a float)
    and forwards it exactly."""
    system = unique_system()
    keys = []
    for default in ("1180591620717411303424", "1180591620717411303425", "1.1805916207174113e21"):
        text = json.dumps(chat(system, tools=1, model="rec-spec"))
        raw = text.replace('"default": 20', f'"default": {default}').encode()
        r = http.post("/v1/prefix/boundary", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        keys.append(r.json()["key"])
    assert len(set(keys)) == 3
    raw = json.dumps(chat(system, tools=1, model="rec-spec")).replace(
        '"default": 20', '"default": 1180591620717411303424').encode()
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    forwarded = json.loads(recorder.last.raw)
    assert forwarded["tools"][0]["function"]["parameters"]["properties"]["limit"]["default"] == 2**70


def test_upstream_model_renames_only_the_model(sdk: Any, recorder: Recorder) -> None:
    messages = [unique_system(), {"role": "user", "content": "Hi"}]
    sdk.chat.completions.create(model="rec-renamed", messages=messages, max_tokens=7)
    assert recorder.last.body == {"messages": messages, "model": "upstream-name", "max_tokens": 7}


# -- streaming, cancellation, upstream errors ---------------------------------------------------


def test_stream_is_relayed_chunk_by_chunk(sdk: Any, recorder: Recorder) -> None:
    """The upstream sends chunk i+1 only once the client has chunk i: a buffering proxy
    would stall (and the upstream would record an ack timeout)."""
    n = 4
    arrived: list[float] = []
    with sdk.chat.completions.with_streaming_response.create(
        model="rec", messages=[unique_system(), {"role": "user", "content": "Stream it."}],
        stream=True, extra_body={"recorder": {"mode": "lockstep", "chunks": n}},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-prefix-cache"] == "miss"
        contents = []
        for i, chunk in enumerate(response.parse()):
            arrived.append(time.monotonic())
            contents.append(chunk.choices[0].delta.content)
            recorder.events[f"ack-{i}"].set()
    assert contents == [f"c{i}" for i in range(n)]
    assert recorder.ack_timeouts == 0
    assert recorder.finished_at is not None and arrived[0] < recorder.sent_at[1] < recorder.finished_at


def test_client_disconnect_cancels_the_upstream_stream(sdk: Any, recorder: Recorder) -> None:
    stream = sdk.chat.completions.create(
        model="rec", messages=[{"role": "user", "content": "Hang."}], stream=True,
        extra_body={"recorder": {"mode": "hang", "chunks": 3}})
    first = next(iter(stream))
    assert first.choices[0].delta.content == "c0"
    stream.close()
    assert recorder.wait("cancelled"), "the upstream stream was not cancelled"


def test_client_disconnect_cancels_a_pending_upstream_request(base: str, recorder: Recorder) -> None:
    body = json.dumps(chat(None, recorder={"mode": "hold"})).encode()
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert recorder.wait("received")
    assert recorder.wait("cancelled"), "the pending upstream request was not cancelled"


@pytest.mark.parametrize("status, body, content_type, error_class, message, code", [
    (429, json.dumps({"error": {"message": "slow down", "type": "rate_limit", "code": "rl"}}),
     "application/json", openai.RateLimitError, "slow down", "rl"),
    (500, "boom", "text/plain", openai.InternalServerError, "boom", "upstream_500"),
    (400, json.dumps({"error": "bad max_tokens"}), "application/json", openai.BadRequestError,
     "bad max_tokens", "upstream_400"),
])
def test_upstream_error_status_is_relayed(sdk: Any, recorder: Recorder, status: int, body: str,
                                          content_type: str, error_class: Any, message: str,
                                          code: str) -> None:
    info: Any
    with pytest.raises(error_class) as info:
        sdk.chat.completions.create(
            model="rec", messages=[{"role": "user", "content": "x"}],
            extra_body={"recorder": {"mode": "error", "status": status, "body": body,
                                     "content_type": content_type}})
    assert info.value.status_code == status
    assert info.value.body["message"] == message and info.value.body["code"] == code


def test_upstream_failing_mid_stream_ends_with_an_error_event(sdk: Any, recorder: Recorder) -> None:
    stream = sdk.chat.completions.create(
        model="rec", messages=[{"role": "user", "content": "Break."}], stream=True,
        extra_body={"recorder": {"mode": "break"}})
    received = []
    with pytest.raises(openai.APIError, match="mid-stream"):
        for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert received == ["c0"]


def test_unreachable_upstream_is_a_502(sdk: Any) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        sdk.chat.completions.create(model="dead", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 502 and info.value.body["code"] == "upstream_unavailable"


def test_model_without_upstream_serves_boundaries_only(sdk: Any, app: Any) -> None:
    before = entries(app)
    with pytest.raises(openai.BadRequestError, match="no upstream and no engine") as info:
        sdk.chat.completions.create(model="boundary-only",
                                    messages=[unique_system(), {"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_servable"
    assert entries(app) == before  # refused before resolving: nothing cached


# -- models, health ------------------------------------------------------------------------------


def test_models_lists_the_configured_models(sdk: Any) -> None:
    ids = [m.id for m in sdk.models.list()]
    assert ids == ["rec", "rec-spec", "rec-renamed", "boundary-only", "strict", "dead"]


def test_healthz_and_readyz(http: Any) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    r = http.get("/readyz")
    assert r.status_code == 503  # the "dead" model's upstream is down
    report = r.json()
    assert report["status"] == "not_ready" and report["store"]["ok"] is True
    assert report["upstreams"]["rec"] == {"ok": True, "status": 200}
    assert report["upstreams"]["dead"]["ok"] is False
    assert "boundary-only" not in report["upstreams"]


# -- bad input: each its 4xx in OpenAI's shape, nothing cached, the service stays up -----------


def _sys() -> dict[str, str]:
    return unique_system("bad")


BAD_BODIES: list[tuple[str, Any, int, str]] = [
    ("malformed json", b'{"messages": [', 400, "invalid_json"),
    ("not an object", b"[1, 2]", 400, "invalid_json"),
    ("NaN is not JSON", b'{"messages": NaN}', 400, "invalid_json"),
    ("no messages", {"model": "rec"}, 400, "invalid_type"),
    ("messages not a list", {"messages": "hello"}, 400, "invalid_type"),
    ("empty messages", {"messages": []}, 400, "invalid_type"),
    ("message not an object", {"messages": ["hi"]}, 400, "invalid_type"),
    ("unknown role", {"messages": [_sys(), {"role": "robot", "content": "x"}]}, 400, "invalid_request"),
    ("content a number", {"messages": [_sys(), {"role": "user", "content": 7}]}, 400, "invalid_request"),
    ("content part not an object", {"messages": [_sys(), {"role": "user", "content": ["x"]}]}, 400,
     "invalid_request"),
    ("tools not a list", {"messages": [_sys(), {"role": "user", "content": "x"}], "tools": {}}, 400,
     "invalid_type"),
    ("kwargs not an object", {"messages": [_sys(), {"role": "user", "content": "x"}],
                              "chat_template_kwargs": [1]}, 400, "invalid_type"),
    ("reserved kwarg", {"messages": [_sys(), {"role": "user", "content": "x"}],
                        "chat_template_kwargs": {"tokenize": False}}, 400, "invalid_request"),
    ("stream not a bool", {"messages": [_sys(), {"role": "user", "content": "x"}], "stream": "yes"},
     400, "invalid_type"),
    ("model not a string", {"model": 3, "messages": [_sys(), {"role": "user", "content": "x"}]}, 400,
     "invalid_type"),
    ("unknown model", {"model": "gpt-9", "messages": [_sys(), {"role": "user", "content": "x"}]}, 404,
     "model_not_found"),
    ("system content parts the template cannot render",
     {"messages": [{"role": "system", "content": [{"type": "text", "text": "S"}]},
                   {"role": "user", "content": "x"}]}, 400, "template_error"),
    ("template raises", {"model": "strict", "messages": [_sys(), {"role": "user", "content": "FORBIDDEN"}]},
     400, "template_error"),
]


@pytest.mark.parametrize("path", ["/v1/prefix/boundary", "/v1/chat/completions"])
@pytest.mark.parametrize("case, body, status, code", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_input_gets_its_4xx(http: Any, app: Any, path: str, case: str, body: Any,
                                status: int, code: str) -> None:
    before = entries(app)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == code
    assert error["type"] in ("invalid_request_error", "not_found_error") and error["message"]
    assert entries(app) == before, "a failed request cached something"
    assert http.get("/healthz").status_code == 200
    ok = http.post("/v1/prefix/boundary", json=chat(unique_system()))
    assert ok.status_code == 200


def test_error_messages_name_the_problem(http: Any) -> None:
    role = http.post("/v1/prefix/boundary", json=BAD_BODIES[7][1]).json()["error"]["message"]
    assert "robot" in role and "messages[1].role" in role
    template = http.post("/v1/prefix/boundary", json=BAD_BODIES[-1][1]).json()["error"]["message"]
    assert "the user turn may not say FORBIDDEN" in template


def test_sdk_sees_bad_roles_as_bad_requests(sdk: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="'robot' is not one of"):
        sdk.chat.completions.create(model="rec", messages=[{"role": "robot", "content": "x"}])


def test_body_over_the_limit_is_413(http: Any) -> None:
    big = chat(unique_system(), user="x" * BODY_LIMIT)
    declared = http.post("/v1/chat/completions", json=big)
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "request_too_large"
    raw = json.dumps(big).encode()
    chunked = http.post("/v1/prefix/boundary", content=iter([raw[:1000], raw[1000:]]),
                        headers={"content-type": "application/json"})  # no Content-Length
    assert chunked.status_code == 413 and "limit" in chunked.json()["error"]["message"]
    assert http.get("/healthz").status_code == 200


def test_unknown_paths_and_methods_keep_the_error_shape(http: Any) -> None:
    missing = http.get("/v1/nothing")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "code"}
    for path in ("/v1/chat/completions", "/v1/prefix/boundary"):  # the latter: its fast lane
        wrong = http.get(path)
        assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
        assert wrong.headers["allow"] == "POST"

"""Graceful shutdown (SIGTERM or Ctrl-C: streams in flight finish within the grace period, new
requests get 503, a stream still running at its end ends with an error event), request ids
(kept or made, sent upstream, returned) and JSON logs that carry them."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefix_cache.http.logs import JsonFormatter, uvicorn_log_config
from prefix_cache.http.request_id import request_id_from
from prefix_cache.service.upstream import Upstream

from tests.support.loopback import local_client
from tests.support.recording_upstream import Recorder
from tests.support.serve_process import ServeProcess
from tests.support.server_thread import ServerThread
from tests.support.sidecar import served, sidecar_app, unique_system


BOUNDED_S = 30.0
GRACE_S = 6.0   # long enough for the acked stream on a busy machine, short of the upstream's hold


def chat(model: str = "rec", **recorder: Any) -> dict[str, Any]:
    return {"model": model, "stream": bool(recorder), "recorder": recorder or None,
            "messages": [unique_system("shutdown"), {"role": "user", "content": "Go."}]}


@pytest.fixture(scope="module")
def app(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> Any:
    return sidecar_app(served("rec", demo_tokenizer, Upstream(recorder_server[1])))


# -- request ids ------------------------------------------------------------------------------


def test_request_id_is_kept_sent_upstream_and_returned(base: str, recorder: Recorder) -> None:
    with local_client(base_url=base) as http:
        r = http.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "trace-42.a:b"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a:b"
        assert recorder.requests[-1].headers["x-request-id"] == "trace-42.a:b"
        made = http.post("/v1/chat/completions", json=chat())
        assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
        assert recorder.requests[-1].headers["x-request-id"] == made.headers["x-request-id"]
        # Not an id (spaces, too long): replaced, never echoed into logs or headers.
        for bad in ("two words", "x" * 129, "a\tb"):
            r = http.get("/healthz", headers={"x-request-id": bad})
            assert r.headers["x-request-id"] != bad
        assert http.get("/nowhere").headers["x-request-id"]   # errors carry one too
    assert request_id_from("ok-1") == "ok-1" and request_id_from(None) != request_id_from(None)


def test_json_formatter_writes_one_object_per_record() -> None:
    import logging

    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/healthz", "1.1", 200), None)
    record.request_id = "r1"
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "r1" and line["status"] == 200 and line["path"] == "/healthz"
    assert line["level"] == "info" and line["logger"] == "uvicorn.access"
    config = uvicorn_log_config("info", log_format="json")
    assert all("request_id" in h["filters"] for h in config["handlers"].values())
    with pytest.raises(ValueError, match="log format"):
        uvicorn_log_config("info", log_format="xml")


def test_serve_writes_json_logs_with_request_ids(demo_folder: Path,
                                                 recorder_server: tuple[Recorder, str]) -> None:
    serve = ServeProcess(["--upstream", recorder_server[1], "--log-format", "json"],
                         demo_folder.parent)
    try:
        base = serve.base_url()
        with local_client(base_url=base) as http:
            r = http.post("/v1/chat/completions", json=chat("demo-qwen3"),
                          headers={"x-request-id": "trace-json-1"})
            assert r.status_code == 200
        access = serve.wait_for(r'"request_id": "trace-json-1"')
        line = json.loads(access.string)
        assert line["logger"] == "uvicorn.access" and line["status"] == 200
        assert line["path"] == "/v1/chat/completions"
    finally:
        serve.stop()
    ours = [ln for ln in serve.output().splitlines() if "uvicorn" in ln or "prefix_cache" in ln]
    assert ours and all(json.loads(ln)["message"] for ln in ours)   # every one of them JSON


def test_text_log_lines_carry_the_request_id(demo_folder: Path,
                                            recorder_server: tuple[Recorder, str]) -> None:
    """The access line (and every line written while serving a request) ends with its id."""
    serve = ServeProcess(["--upstream", recorder_server[1]], demo_folder.parent)
    try:
        base = serve.base_url()
        with local_client(base_url=base) as http:
            r = http.post("/v1/chat/completions", json=chat("demo-qwen3"),
                          headers={"x-request-id": "trace-text-1"})
            assert r.status_code == 200
            made = http.get("/healthz").headers["x-request-id"]
        access = serve.wait_for(r'"POST /v1/chat/completions HTTP/1.1" 200.*')
        assert access.group(0).rstrip().endswith(" request_id=trace-text-1"), access.group(0)
        serve.wait_for(rf'"GET /healthz HTTP/1.1" 200 OK request_id={made}$')
    finally:
        serve.stop()
    started = serve.log[0]
    assert "request_id" not in started   # outside a request: the line as uvicorn writes it


def test_serve_starts_clean_only_its_own_lines_and_uvicorns(demo_folder: Path) -> None:
    """No library noise on start (transformers' "PyTorch was not found" read as a broken
    install): every line is the project's or uvicorn's."""
    serve = ServeProcess([], demo_folder.parent)
    try:
        serve.base_url()
    finally:
        serve.stop()
    lines = [ln for ln in serve.output().splitlines() if ln.strip()]
    assert lines and not [ln for ln in lines if "PyTorch" in ln or "torch" in ln.lower()]
    assert all(re.match(r"(INFO|WARNING|ERROR):\s", ln) for ln in lines), lines


# -- draining ---------------------------------------------------------------------------------


def test_a_draining_server_answers_503_and_reports_not_ready(demo_tokenizer: Any) -> None:
    app = sidecar_app(served("demo", demo_tokenizer))
    with ServerThread(app) as url, local_client(base_url=url) as http:
        assert http.get("/readyz").status_code == 200
        app.state.service.drain.start()
        for path in ("/readyz", "/healthz", "/v1/models"):
            r = http.get(path)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert r.headers["retry-after"] and r.headers["connection"] == "close"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_finishes_streams_in_flight_refuses_new_ones_then_exits(
        demo_folder: Path, recorder_server: tuple[Recorder, str], recorder: Recorder,
        stop: signal.Signals) -> None:
    """SIGINT (Ctrl-C) drains exactly as SIGTERM does: one line, no traceback."""
    serve = ServeProcess(["--upstream", recorder_server[1]], demo_folder.parent,
                         env={"PREFIX_CACHE_SHUTDOWN_GRACE_S": str(GRACE_S)})
    try:
        base = serve.base_url()
        go = threading.Event()
        started = {"acked": threading.Event(), "hung": threading.Event()}
        seen: dict[str, list[str]] = {"acked": [], "hung": []}

        def stream(name: str, body: dict[str, Any]) -> None:
            try:
                with local_client(base_url=base, timeout=BOUNDED_S) as client, \
                        client.stream("POST", "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        seen[name].append(line[6:])
                        started[name].set()
                        if name == "acked" and line[6:] != "[DONE]":
                            go.wait(BOUNDED_S)  # hold chunk i+1 until the test says so
                            recorder.events[f"ack-{len(seen[name]) - 1}"].set()
            except httpx.HTTPError as exc:
                seen[name].append(f"cut: {type(exc).__name__}")

        threads = [threading.Thread(target=stream, args=("acked", chat("demo-qwen3", mode="lockstep", chunks=4))),
                   threading.Thread(target=stream, args=("hung", chat("demo-qwen3", mode="hang", chunks=3)))]
        for t in threads:
            t.start()
        assert all(e.wait(BOUNDED_S) for e in started.values()), seen
        serve.proc.send_signal(stop)
        with local_client(base_url=base) as http:
            deadline = time.monotonic() + BOUNDED_S
            while (r := http.get("/healthz")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        go.set()   # the stream in flight now runs to its end, inside the grace period
        for t in threads:
            t.join(BOUNDED_S * 2)
        assert seen["acked"][-1] == "[DONE]" and len(seen["acked"]) == 5, seen["acked"]
        # Cut when the grace period ended, with an event the client reads, and a whole body.
        assert "[DONE]" not in seen["hung"] and not seen["hung"][-1].startswith("cut:")
        assert json.loads(seen["hung"][-1])["error"]["code"] == "shutting_down", seen["hung"]
        serve.proc.wait(BOUNDED_S)
        assert serve.proc.returncode == 0
        assert recorder.streams_open == 0
    finally:
        serve.stop()
    log = serve.output()
    assert log.count("draining:") == 1 and "cancelling 1 request(s)" in log
    assert f"{stop.name}: draining: 2 request(s) in flight" in log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "without completing response" not in log, log


def test_ctrl_c_mid_stream_ends_each_apis_stream_with_an_error_event_its_sdk_reads(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """``serve --engine mlx``: Ctrl-C while three long streams run (chat completions,
    Messages, Responses, through the real SDKs). The drain lets them run on to the grace's end
    (tokens still arrive after the signal), then each ends with its API's error event, which
    its SDK raises or yields, instead of a connection cut mid-stream (curl's rc 18)."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    serve = ServeProcess(["--model", str(tiny_model_dir), "--engine", "mlx"], tmp_path,
                         env={"PREFIX_CACHE_SHUTDOWN_GRACE_S": "3"})
    signalled = threading.Event()
    after: dict[str, int] = {"chat": 0, "messages": 0, "responses": 0}   # tokens after the signal
    ends: dict[str, str] = {}
    first = {name: threading.Event() for name in after}
    long = {"max_tokens": 4000}
    ask = [{"role": "user", "content": "Count to one thousand."}]

    def got(name: str) -> None:
        first[name].set()
        after[name] += signalled.is_set()

    def chat(base: str) -> None:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        try:
            for _ in client.chat.completions.create(model="tiny-qwen3", messages=ask,
                                                    stream=True, **long):
                got("chat")
            ends["chat"] = "finished"
        except openai.APIError as exc:
            ends["chat"] = str(exc)

    def messages(base: str) -> None:
        client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        try:
            for _ in client.messages.create(model="tiny-qwen3", messages=ask, stream=True,
                                            **long):
                got("messages")
            ends["messages"] = "finished"
        except anthropic.APIStatusError as exc:
            ends["messages"] = f"{exc.status_code} {exc}"

    def responses(base: str) -> None:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        ends["responses"] = "finished"
        for event in client.responses.create(model="tiny-qwen3", input="Count to one thousand.",
                                             stream=True, max_output_tokens=4000):
            got("responses")
            if event.type == "error":
                ends["responses"] = event.message

    try:
        base = serve.base_url()
        threads = [threading.Thread(target=f, args=(base,)) for f in (chat, messages, responses)]
        for t in threads:
            t.start()
        assert all(e.wait(BOUNDED_S) for e in first.values()), serve.log
        signalled.set()
        serve.proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(BOUNDED_S * 2)
        assert serve.proc.wait(BOUNDED_S) == 0
    finally:
        serve.stop()
    log = serve.output()
    assert all(after.values()), after   # the drain let the streams run on
    for name, end in ends.items():
        assert "shutting down" in end, (name, end)
    assert "SIGINT: draining: 3 request(s) in flight" in log, log
    assert "grace period of 3.0 s over: cancelling 3 request(s)" in log, log
    assert "Traceback" not in log and "without completing response" not in log, log

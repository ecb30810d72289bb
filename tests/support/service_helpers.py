"""Helpers of the service tests: uvicorn in a thread, a recording upstream, loopback clients.

Every wait here is bounded, and each waits on an event or polls for readiness, never a guess.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefix_cache.keys import model_label
from prefix_cache.service.models import ServedModel
from prefix_cache.service.upstream import Upstream

STARTUP_TIMEOUT_S = 15.0
SERVE_STARTUP_TIMEOUT_S = 60.0  # a `prefix-cache serve` process: imports, model, engine
REPO = Path(__file__).resolve().parents[2]
EVENT_TIMEOUT_S = 10.0     # how long a test waits for something the upstream reports
HOLD_S = 15.0              # how long the recorder holds a request that should be cancelled first


def wait_until(condition: Any, what: str | None = None, timeout: float = EVENT_TIMEOUT_S,
               interval: float = 0.02) -> bool:
    """Poll ``condition`` until it holds, for at most ``timeout`` seconds (a bound, never a
    timing assertion). With ``what``, running out is an AssertionError naming what was awaited;
    without, the answer is whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            if what is not None:
                raise AssertionError(f"timed out waiting for {what}")
            return False
        time.sleep(interval)
    return True


def unique_system(tag: str = "") -> dict[str, str]:
    """A system message no other test sends: a guaranteed miss on first use."""
    return {"role": "system", "content": f"You are agent {tag}{uuid.uuid4().hex}."}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_client(timeout: float = 30.0, **kwargs: Any) -> httpx.Client:
    """An httpx client that ignores proxy variables: loopback traffic only."""
    return httpx.Client(trust_env=False, timeout=timeout, **kwargs)


def openai_client(base_url: str, api_key: str = "sk-none") -> Any:
    """The real OpenAI SDK, no retries, on its own HTTP stack (httpx2 from openai 3 on)."""
    import openai

    sdk_http: Any
    try:
        import httpx2 as sdk_http  # type: ignore[import-not-found,no-redef,unused-ignore]
    except ImportError:
        sdk_http = httpx
    client: Any = sdk_http.Client(trust_env=False, timeout=30.0)
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                         timeout=30.0, http_client=client)


# -- uvicorn on loopback ------------------------------------------------------------------------


class ServerThread:
    """An ASGI app served by a real uvicorn in a thread, on a socket bound before it starts."""

    def __init__(self, app: Any, log_level: str = "warning") -> None:
        self.app = app
        self.log_level = log_level

    def __enter__(self) -> str:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=self.log_level, lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True, name=f"uvicorn-{port}")
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:  # readiness poll, bounded
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn on port {port} did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=STARTUP_TIMEOUT_S)


# -- the recording upstream ---------------------------------------------------------------------


@dataclass
class Recorded:
    headers: dict[str, str]
    raw: bytes
    body: Any


@dataclass
class Recorder:
    """What the recording upstream saw, and events a test can wait on or set."""

    requests: list[Recorded] = field(default_factory=list)
    events: defaultdict[str, threading.Event] = field(
        default_factory=lambda: defaultdict(threading.Event))
    sent_at: list[float] = field(default_factory=list)   # when each stream chunk left
    finished_at: float | None = None
    ack_timeouts: int = 0
    streams_open: int = 0     # streams being sent now (a stream nobody cancelled stays here)

    def reset(self) -> None:
        self.requests.clear()
        self.events.clear()
        self.sent_at.clear()
        self.finished_at = None
        self.ack_timeouts = 0
        self.streams_open = 0

    def wait(self, name: str, timeout: float = EVENT_TIMEOUT_S) -> bool:
        return self.events[name].wait(timeout)

    @property
    def last(self) -> Recorded:
        return self.requests[-1]


def _chunk(model: str, i: int, last: bool) -> bytes:
    data = {"id": "chatcmpl-rec", "object": "chat.completion.chunk", "created": 0,
            "model": model, "choices": [{"index": 0, "delta": {"content": f"c{i}"},
                                         "finish_reason": "stop" if last else None}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def recording_upstream(rec: Recorder) -> FastAPI:
    """An OpenAI-compatible upstream that records each request exactly as it arrived.

    A request's ``recorder`` field (passed through by the sidecar like any unknown field) picks
    the behaviour: ``{"mode": "error", "status": N, "body": "...", "content_type": "..."}``,
    ``"hold"`` (never answers; sets event "cancelled" when the caller goes away), and for
    streams ``"chunks": N`` plus ``"lockstep"`` (chunk i+1 only after event "ack-i"),
    ``"hang"`` (one chunk, then waits to be cancelled), ``"break"`` (one chunk, then dies);
    ``"delay_s"`` waits that long before answering (a slow upstream).
    """
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        rec.requests.append(Recorded(dict(request.headers), raw, body))
        rec.events["received"].set()
        ctl = body.get("recorder") or {}
        mode = ctl.get("mode", "ok")
        if ctl.get("delay_s"):
            await asyncio.sleep(float(ctl["delay_s"]))
        if mode == "error":
            return Response(ctl.get("body", ""), status_code=ctl["status"],
                            media_type=ctl.get("content_type", "application/json"))
        if mode == "hold":
            try:  # the body is read: the next message is the disconnect
                message = await asyncio.wait_for(request.receive(), HOLD_S)
            except TimeoutError:
                return JSONResponse({"error": "held too long"}, status_code=504)
            if message["type"] == "http.disconnect":
                rec.events["cancelled"].set()
            return Response(status_code=204)
        model = str(body.get("model"))
        if body.get("stream"):
            return StreamingResponse(_stream(rec, model, mode, int(ctl.get("chunks", 3))),
                                     media_type="text/event-stream")
        return JSONResponse({
            "id": "chatcmpl-rec", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "recorded"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })

    return app


async def _stream(rec: Recorder, model: str, mode: str, chunks: int) -> AsyncIterator[bytes]:
    rec.streams_open += 1
    try:
        for i in range(chunks):
            rec.sent_at.append(time.monotonic())
            yield _chunk(model, i, last=i == chunks - 1)
            if mode == "hang":
                await asyncio.sleep(HOLD_S)  # until the sidecar closes the connection
            if mode == "break":
                raise RuntimeError("the recorder breaks mid-stream, as asked")
            if mode == "lockstep" and i < chunks - 1:
                acked = await asyncio.to_thread(rec.events[f"ack-{i}"].wait, EVENT_TIMEOUT_S)
                rec.ack_timeouts += not acked
        # Recorded before the last yield: after it the generator may never be resumed (the
        # client can be gone already), so a timestamp taken there would race the test.
        rec.finished_at = time.monotonic()
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        rec.events["cancelled"].set()
        raise
    finally:
        rec.streams_open -= 1


def served(name: str, tokenizer: Any, upstream: Upstream | None = None) -> ServedModel:
    return ServedModel(name, model_label(name), tokenizer, upstream)


# -- a `prefix-cache serve` process ------------------------------------------------------------


class ServeProcess:
    """``python -m prefix_cache.cli serve`` on a free port, its log read line by line."""

    def __init__(self, args: list[str], home: Path, env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PREFIX_CACHE_HOME": str(home), "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefix_cache.cli", "serve", "--port", "0", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output

    def wait_for(self, pattern: str, timeout: float = SERVE_STARTUP_TIMEOUT_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.log.append(line)
            if line == "":
                break
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r}; log:\n{''.join(self.log)}")

    def output(self, timeout: float = STARTUP_TIMEOUT_S) -> str:
        """Everything the process wrote, once it has exited (bounded)."""
        self.proc.wait(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line == "":
                break
            self.log.append(line)
        return "".join(self.log)

    def base_url(self) -> str:
        url = self.wait_for(r"Uvicorn running on (http://127\.0\.0\.1:\d+)").group(1)
        with local_client(timeout=2.0) as client:  # workers start after the parent binds
            deadline = time.monotonic() + SERVE_STARTUP_TIMEOUT_S
            while time.monotonic() < deadline:
                try:
                    if client.get(f"{url}/healthz").status_code == 200:
                        return url
                except Exception:
                    pass
                time.sleep(0.1)
        raise AssertionError("the server never became healthy")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout=STARTUP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout=STARTUP_TIMEOUT_S)


# -- a real browser ------------------------------------------------------------------------------

# Screenshots the browser tests leave for people to look at (CI keeps the folder).
ARTIFACTS = Path(os.environ.get("PREFIX_CACHE_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@contextmanager
def headless_chromium() -> Iterator[Any]:
    """A Selenium driver on Debian's headless Chromium, its browser log kept (callers skip when
    ``CHROMIUM`` or ``CHROMEDRIVER`` is None, or selenium is missing)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--disable-quic", "--window-size=1280,1000"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def wait_for_js(driver: Any, js: str, timeout: float = 20.0) -> Any:
    """Poll ``js`` in the page until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(js)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {js}")


def browser_errors(driver: Any) -> list[Any]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]

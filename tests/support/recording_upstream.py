"""A recording upstream: an OpenAI-compatible server that records each request exactly as it
arrived and answers as the request's ``recorder`` field asks (errors, holds, slow or broken
streams)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .waits import EVENT_TIMEOUT_S

HOLD_S = 15.0              # how long the recorder holds a request that should be cancelled first


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

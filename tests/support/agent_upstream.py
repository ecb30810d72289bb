"""A recording upstream for the agent APIs: it serves chat completions, Anthropic Messages and
OpenAI Responses, records each request exactly as it arrived, and answers what the test set
(text or a tool call; JSON or SSE as asked).

Its answers follow each API's documented shapes, so the sidecar's relay (native APIs) and its
conversion back (chat completions) are both seen by the real SDKs.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .recording_upstream import Recorded

# One tool in each API's shape: Anthropic's (input_schema), chat's and Responses' function.
READ = {"name": "read_file", "description": "Read a file of the workspace.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                         "required": ["path"]}}
READ_CHAT = {"type": "function", "function": {"name": "read_file",
                                              "description": READ["description"],
                                              "parameters": READ["input_schema"]}}
READ_RESPONSES = {"type": "function", "name": "read_file", "description": READ["description"],
                  "parameters": READ["input_schema"]}


@dataclass
class AgentRecorder:
    """Requests by path; what the next answers say."""

    requests: list[tuple[str, Recorded]] = field(default_factory=list)
    text: str = "recorded"
    tool_call: tuple[str, str, dict[str, Any]] | None = None   # (id, name, arguments)
    raw_arguments: str | None = None                           # the call's arguments as sent
    usage: tuple[int, int, int] = (11, 3, 4)                   # prompt, completion, cached
    error: tuple[int, Any] | None = None                       # (status, JSON body) to answer
    error_headers: dict[str, str] = field(default_factory=dict)  # sent with that error
    errors_left: int | None = None                             # None: every request fails
    arrived_at: list[float] = field(default_factory=list)      # monotonic time of each request
    break_stream: bool = False                                 # die after the first event
    hold: threading.Event | None = None                        # chat answers wait for it

    def reset(self) -> None:
        self.requests.clear()
        self.text, self.tool_call, self.usage, self.error = "recorded", None, (11, 3, 4), None
        self.break_stream = False
        self.hold = None
        self.raw_arguments = None
        self.error_headers, self.errors_left = {}, None
        self.arrived_at.clear()

    def last(self, path: str) -> Recorded:
        return [r for p, r in self.requests if p == path][-1]

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data) + "\n\n").encode()


def agent_upstream(rec: AgentRecorder) -> FastAPI:
    app = FastAPI()

    async def record(request: Request, path: str) -> dict[str, Any]:
        raw = await request.body()
        body = json.loads(raw)
        rec.requests.append((path, Recorded(dict(request.headers), raw, body)))
        rec.arrived_at.append(time.monotonic())
        return body

    def failure() -> Response | None:
        """The error the test asked for, if any (``errors_left`` times, or every time)."""
        if rec.error is None or rec.errors_left == 0:
            return None
        if rec.errors_left is not None:
            rec.errors_left -= 1
        return JSONResponse(rec.error[1], status_code=rec.error[0], headers=rec.error_headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await record(request, "chat")
        if rec.hold is not None:  # an answer in flight until the test lets it go
            await asyncio.to_thread(rec.hold.wait, 30)
        if (failed := failure()) is not None:
            return failed
        if body.get("stream"):
            return StreamingResponse(_chat_stream(rec, body), media_type="text/event-stream")
        message: dict[str, Any] = {"role": "assistant", "content": rec.text}
        finish = "stop"
        if rec.tool_call is not None:
            call_id, name, args = rec.tool_call
            message["tool_calls"] = [{"id": call_id, "type": "function", "function": {
                "name": name, "arguments": rec.raw_arguments or json.dumps(args)}}]
            finish = "tool_calls"
        prompt, completion, cached = rec.usage
        return JSONResponse({
            "id": "chatcmpl-rec", "object": "chat.completion", "created": 0,
            "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": finish, "message": message}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}})

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await record(request, "messages")
        if (failed := failure()) is not None:
            return failed
        message = {"id": "msg_rec", "type": "message", "role": "assistant",
                   "model": body.get("model"), "content": [{"type": "text", "text": rec.text}],
                   "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": {"input_tokens": 11, "output_tokens": 1}}
        if not body.get("stream"):
            return JSONResponse(message)

        async def events() -> AsyncIterator[bytes]:
            yield _sse({"type": "message_start", "message": {**message, "content": []}},
                       "message_start")
            if rec.break_stream:
                raise RuntimeError("the recorder breaks mid-stream, as asked")
            yield _sse({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}, "content_block_start")
            yield _sse({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": rec.text}},
                       "content_block_delta")
            yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            yield _sse({"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                           "stop_sequence": None},
                        "usage": {"output_tokens": 1}}, "message_delta")
            yield _sse({"type": "message_stop"}, "message_stop")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await record(request, "responses")
        if (failed := failure()) is not None:
            return failed
        rid = f"resp_rec_{uuid.uuid4().hex[:8]}"
        item = {"type": "message", "id": f"msg_{rid}", "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": rec.text, "annotations": []}]}
        response = {"id": rid, "object": "response", "created_at": 0, "status": "completed",
                    "model": body.get("model"), "output": [item], "error": None,
                    "incomplete_details": None, "parallel_tool_calls": True, "tools": [],
                    "tool_choice": "auto",
                    "usage": {"input_tokens": 11, "output_tokens": 1, "total_tokens": 12,
                              "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}}}
        if not body.get("stream"):
            return JSONResponse(response)

        async def events() -> AsyncIterator[bytes]:
            start = {**response, "status": "in_progress", "output": [], "usage": None}
            yield _sse({"type": "response.created", "sequence_number": 0, "response": start},
                       "response.created")
            yield _sse({"type": "response.output_item.added", "sequence_number": 1,
                        "output_index": 0, "item": {**item, "status": "in_progress",
                                                    "content": []}},
                       "response.output_item.added")
            yield _sse({"type": "response.output_item.done", "sequence_number": 2,
                        "output_index": 0, "item": item}, "response.output_item.done")
            yield _sse({"type": "response.completed", "sequence_number": 3,
                        "response": response}, "response.completed")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def _chat_stream(rec: AgentRecorder, body: dict[str, Any]) -> AsyncIterator[bytes]:
    base = {"id": "chatcmpl-rec", "object": "chat.completion.chunk", "created": 0,
            "model": body.get("model")}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse({**base, "choices": [{"index": 0, "delta": delta,
                                          "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    for piece in (rec.text[: len(rec.text) // 2], rec.text[len(rec.text) // 2:]):
        yield chunk({"content": piece})
    finish = "stop"
    if rec.tool_call is not None:
        call_id, name, args = rec.tool_call
        text = rec.raw_arguments or json.dumps(args)
        yield chunk({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                     "function": {"name": name, "arguments": ""}}]})
        for piece in (text[:5], text[5:]):
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        finish = "tool_calls"
    yield chunk({}, finish)
    if (body.get("stream_options") or {}).get("include_usage"):
        prompt, completion, cached = rec.usage
        yield _sse({**base, "choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}})
    yield b"data: [DONE]\n\n"

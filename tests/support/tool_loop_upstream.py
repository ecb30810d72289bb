"""A scripted upstream for the real agent clients: on each of the three APIs (chat completions,
Anthropic Messages, OpenAI Responses; JSON or SSE) it asks for two tool calls and then answers,
and it records every request exactly as it arrived.

The rule, stated once: a request whose conversation already holds N tool results (N < 2) and
that offers the tool the client's loop uses gets a call of that tool; anything else (the third
turn, a title or summary request without tools) gets the text ``ANSWER``. The tool and its
arguments are picked from the names the request offers, so the same upstream drives Claude
Code (``Read``), Codex (``shell``/``exec_command``/``update_plan``) and opencode (``read``).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .recording_upstream import Recorded

ANSWER = "Both files are read: the loop is done."
TITLE = "Reading two files"
TOOL_CALLS = 2


@dataclass
class LoopRecorder:
    """Every request by API, and the files the scripted calls read (paths in the client's
    working directory)."""

    files: tuple[str, str] = ("alpha.txt", "beta.txt")
    requests: list[tuple[str, Recorded]] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: {"prompt": 0, "cached": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()

    def bodies(self, api: str) -> list[dict[str, Any]]:
        return [r.body for a, r in self.requests if a == api]


# (tool name, arguments for reading ``path``); the first name a request offers is used.
TOOLS: tuple[tuple[str, Any], ...] = (
    ("Read", lambda path: {"file_path": path}),                       # Claude Code
    ("read", lambda path: {"filePath": path}),                        # opencode
    ("exec_command", lambda path: {"cmd": f"cat {path}"}),           # Codex (unified exec)
    ("shell", lambda path: {"command": ["cat", path]}),               # Codex (classic shell)
    ("update_plan", lambda path: {"plan": [{"step": f"read {path}",  # Codex, no sandbox
                                             "status": "in_progress"}]}),
)


def _tool_names(tools: list[Any] | None) -> set[str]:
    """Every function name a request offers, namespaces' members included."""
    names: set[str] = set()
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if isinstance(fn.get("name"), str):
            names.add(fn["name"])
        names |= _tool_names(tool.get("tools"))
    return names


def _results_chat(body: dict[str, Any]) -> int:
    return sum(1 for m in body.get("messages") or [] if m.get("role") == "tool")


def _results_messages(body: dict[str, Any]) -> int:
    return sum(1 for m in body.get("messages") or [] if isinstance(m.get("content"), list)
               for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result")


def _results_responses(body: dict[str, Any]) -> int:
    items = body.get("input")
    if not isinstance(items, list):
        return 0
    return sum(1 for i in items if isinstance(i, dict)
               and i.get("type") in ("function_call_output", "custom_tool_call_output"))


def next_step(rec: LoopRecorder, tools: list[Any] | None, results: int
              ) -> tuple[str, dict[str, Any]] | None:
    """The tool call this request gets (name, arguments), or None for the text answer."""
    if results >= TOOL_CALLS:
        return None
    offered = _tool_names(tools)
    for name, args in TOOLS:
        if name in offered:
            return name, args(rec.files[results])
    return None


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data) + "\n\n").encode()


def _usage_tokens(raw: bytes) -> int:
    """A prompt-token count the scripted upstream reports: a quarter of the body's bytes, as
    an upstream that computed every token would (it keeps no cache)."""
    return max(1, len(raw) // 4)


def tool_loop_upstream(rec: LoopRecorder) -> FastAPI:
    app = FastAPI()

    async def record(request: Request, api: str) -> tuple[dict[str, Any], bytes]:
        raw = await request.body()
        body = json.loads(raw)
        with rec.lock:
            rec.requests.append((api, Recorded(dict(request.headers), raw, body)))
        return body, raw

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body, raw = await record(request, "chat")
        step = next_step(rec, body.get("tools"), _results_chat(body))
        prompt = _usage_tokens(raw)
        if body.get("stream"):
            return StreamingResponse(_chat_stream(body, step, prompt),
                                     media_type="text/event-stream")
        message: dict[str, Any] = {"role": "assistant", "content": TITLE if not body.get(
            "tools") else ANSWER}
        if step is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [_chat_call(step)]}
        return JSONResponse({
            "id": "chatcmpl-loop", "object": "chat.completion", "created": 0,
            "model": body.get("model"),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if step else "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 5,
                      "total_tokens": prompt + 5,
                      "prompt_tokens_details": {"cached_tokens": 0}}})

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body, raw = await record(request, "messages")
        step = next_step(rec, body.get("tools"), _results_messages(body))
        prompt = _usage_tokens(raw)
        if step is None:
            block: dict[str, Any] = {"type": "text", "text": ANSWER if body.get("tools")
                                     else TITLE}
        else:
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}",
                     "name": step[0], "input": step[1]}
        stop = "tool_use" if step else "end_turn"
        usage = {"input_tokens": prompt, "output_tokens": 5, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}
        message = {"id": f"msg_{uuid.uuid4().hex[:20]}", "type": "message",
                   "role": "assistant", "model": body.get("model"), "content": [block],
                   "stop_reason": stop, "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            return JSONResponse(message)
        return StreamingResponse(_iter(_messages_stream(message, block)),
                                 media_type="text/event-stream")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body, raw = await record(request, "responses")
        step = next_step(rec, body.get("tools"), _results_responses(body))
        prompt = _usage_tokens(raw)
        rid = f"resp_{uuid.uuid4().hex[:20]}"
        if step is None:
            item: dict[str, Any] = {
                "type": "message", "id": f"msg_{rid}", "status": "completed",
                "role": "assistant", "content": [{"type": "output_text", "annotations": [],
                                                  "text": ANSWER if body.get("tools")
                                                  else TITLE}]}
        else:
            item = {"type": "function_call", "id": f"fc_{rid}", "status": "completed",
                    "call_id": f"call_{uuid.uuid4().hex[:20]}", "name": step[0],
                    "arguments": json.dumps(step[1])}
        response = {"id": rid, "object": "response", "created_at": 0, "status": "completed",
                    "model": body.get("model"), "output": [item], "error": None,
                    "incomplete_details": None, "parallel_tool_calls": False, "tools": [],
                    "tool_choice": "auto",
                    "usage": {"input_tokens": prompt, "output_tokens": 5,
                              "total_tokens": prompt + 5,
                              "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}}}
        if not body.get("stream"):
            return JSONResponse(response)
        return StreamingResponse(_iter(_responses_stream(response, item)),
                                 media_type="text/event-stream")

    return app


async def _iter(events: Iterator[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def _chat_call(step: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:20]}", "type": "function",
            "function": {"name": step[0], "arguments": json.dumps(step[1])}}


async def _chat_stream(body: dict[str, Any], step: tuple[str, dict[str, Any]] | None,
                       prompt: int) -> AsyncIterator[bytes]:
    base = {"id": "chatcmpl-loop", "object": "chat.completion.chunk", "created": 0,
            "model": body.get("model")}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    if step is None:
        text = ANSWER if body.get("tools") else TITLE
        for piece in (text[: len(text) // 2], text[len(text) // 2:]):
            yield chunk({"content": piece})
    else:
        call = _chat_call(step)
        args = call["function"]["arguments"]
        yield chunk({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                     "function": {"name": step[0], "arguments": ""}}]})
        for piece in (args[:5], args[5:]):
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    yield chunk({}, "tool_calls" if step else "stop")
    if (body.get("stream_options") or {}).get("include_usage"):
        yield _sse({**base, "choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5,
            "prompt_tokens_details": {"cached_tokens": 0}}})
    yield b"data: [DONE]\n\n"


def _messages_stream(message: dict[str, Any], block: dict[str, Any]) -> Iterator[bytes]:
    start = {**message, "content": [], "stop_reason": None,
             "usage": {**message["usage"], "output_tokens": 0}}
    yield _sse({"type": "message_start", "message": start}, "message_start")
    if block["type"] == "text":
        yield _sse({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}, "content_block_start")
        yield _sse({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": block["text"]}},
                   "content_block_delta")
    else:
        yield _sse({"type": "content_block_start", "index": 0,
                    "content_block": {**block, "input": {}}}, "content_block_start")
        yield _sse({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "input_json_delta",
                              "partial_json": json.dumps(block["input"])}},
                   "content_block_delta")
    yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    yield _sse({"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                   "stop_sequence": None},
                "usage": {"output_tokens": 5}}, "message_delta")
    yield _sse({"type": "message_stop"}, "message_stop")


def _responses_stream(response: dict[str, Any], item: dict[str, Any]) -> Iterator[bytes]:
    n = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal n
        n += 1
        return _sse({"type": kind, "sequence_number": n - 1, **data}, kind)

    start = {**response, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    if item["type"] == "message":
        yield event("response.output_item.added", output_index=0,
                    item={**item, "status": "in_progress", "content": []})
        part = item["content"][0]
        yield event("response.content_part.added", output_index=0, item_id=item["id"],
                    content_index=0, part={**part, "text": ""})
        yield event("response.output_text.delta", output_index=0, item_id=item["id"],
                    content_index=0, delta=part["text"])
        yield event("response.output_text.done", output_index=0, item_id=item["id"],
                    content_index=0, text=part["text"])
        yield event("response.content_part.done", output_index=0, item_id=item["id"],
                    content_index=0, part=part)
    else:
        yield event("response.output_item.added", output_index=0,
                    item={**item, "status": "in_progress", "arguments": ""})
        yield event("response.function_call_arguments.delta", output_index=0,
                    item_id=item["id"], delta=item["arguments"])
        yield event("response.function_call_arguments.done", output_index=0,
                    item_id=item["id"], arguments=item["arguments"])
    yield event("response.output_item.done", output_index=0, item=item)
    yield event("response.completed", response=response)


def main() -> None:
    """``python -m tests.support.tool_loop_upstream --port P [--record FILE.jsonl]``: serve on
    loopback; with ``--record``, append each request (api, query, headers, body) to the file
    (how tests/agent_clients/fixtures were recorded)."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--record", default=None)
    args = parser.parse_args()
    rec = LoopRecorder()
    app = tool_loop_upstream(rec)

    @app.middleware("http")
    async def dump(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        with rec.lock:
            pending = list(rec.requests)
            rec.requests.clear()
        if args.record:
            with open(args.record, "a") as f:
                for api, r in pending:
                    f.write(json.dumps({"api": api, "query": request.url.query,
                                        "headers": r.headers, "body": r.body}) + "\n")
        return response

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

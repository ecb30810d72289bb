"""A backend's outputs as OpenAI chat completions: one ``chat.completion``, or SSE
``chat.completion.chunk`` events ending in ``data: [DONE]``. Tool calls the engine cut out of
its text are ``tool_calls`` (whole, one chunk each), with finish reason "tool_calls".

``usage.prompt_tokens_details.cached_tokens`` reports the prompt tokens whose KV the engine
restored. A client that goes away cancels the generation: Starlette cancels a streaming body,
``until_disconnect`` a whole one, and closing the backend's iterator stops the engine.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..http.errors import ClientDisconnected, error_body
from ..http.relay import until_disconnect
from .backend import BackendError, BackendRequest, ChatBackend, ToolCall, Usage
from .openai_params import ChatParams


def usage_body(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage(0, 0)
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


async def complete(backend: ChatBackend, params: ChatParams,
                   request: BackendRequest) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    parts: list[str] = []
    calls: list[dict[str, Any]] = []
    finish, usage = None, None
    async with aclosing(backend.generate(request)) as outputs:
        async for out in outputs:
            parts.append(out.text)
            calls += [_call(call) for call in out.tool_calls]
            finish, usage = out.finish_reason or finish, out.usage or usage
    message: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{request.request_id}", "object": "chat.completion",
        "created": int(time.time()), "model": params.model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish or "length"}],
        "usage": usage_body(usage),
    }


def _call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    return {**out, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


async def stream(backend: ChatBackend, params: ChatParams,
                 request: BackendRequest) -> AsyncIterator[bytes]:
    """SSE events: ``data: {chat.completion.chunk}`` ... ``data: [DONE]``."""
    base = {"id": f"chatcmpl-{request.request_id}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": params.model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}
        return _event(data)

    finish, usage = None, None
    calls = 0
    yield chunk({"role": "assistant", "content": ""})
    try:
        async with aclosing(backend.generate(request)) as outputs:
            async for out in outputs:
                if out.text:
                    yield chunk({"content": out.text})
                for call in out.tool_calls:
                    yield chunk({"tool_calls": [_call(call, calls)]})
                    calls += 1
                finish, usage = out.finish_reason or finish, out.usage or usage
    except BackendError as exc:  # the status is long sent: end the stream with the reason
        yield _event(error_body(str(exc), "server_error", "engine_error"))
        return
    yield chunk({}, finish or "length")
    if params.include_usage:
        yield _event({**base, "choices": [], "usage": usage_body(usage)})
    yield b"data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def respond_chat(http_request: Request, backend: ChatBackend, params: ChatParams,
                       request: BackendRequest,
                       headers: Mapping[str, str] | None = None) -> Response:
    """Check ``request`` (a 400 before anything runs), run it, answer JSON or SSE."""
    request = backend.check(request)
    headers = dict(headers or {})
    if params.stream:
        headers["x-accel-buffering"] = "no"
        return StreamingResponse(stream(backend, params, request),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", **headers})
    try:
        completion, disconnected = await until_disconnect(
            http_request.receive, complete(backend, params, request))
    except BackendError as exc:
        return Response(orjson.dumps(error_body(str(exc), "server_error", "engine_error")),
                        status_code=500, media_type="application/json", headers=headers)
    if disconnected or completion is None:
        raise ClientDisconnected("the client disconnected before the completion was done")
    return Response(orjson.dumps(completion), media_type="application/json", headers=headers)

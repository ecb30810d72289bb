"""OpenAI chat completions over the MLX engine: request parameters in, ``chat.completion`` or
SSE ``chat.completion.chunk``s out.

    body ──> ChatEngine.parse(body) ──> ChatParams          (400 on bad parameters, nothing run)
    prompt ids + boundary + namespace ──> ChatEngine.request(params, ...) ──> GenerationRequest
    ChatEngine.respond(http_request, params, request, headers) ──> JSON or text/event-stream

The prompt ids come from the caller: the sidecar passes the ids its cache cut the boundary in
(its tokenizer and the engine's are the same model folder's), ``serve-engine`` takes them from
``prompt_token_ids`` or renders the chat template itself. Text is decoded incrementally from the
generated ids (``IncrementalDecoder``): a multi-byte character split across tokens is held back
until it is whole. ``stop`` strings end the completion where they first appear (the stop text is
not returned); the model's end-of-turn tokens end it with ``finish_reason: "stop"`` and are not
returned either. ``usage.prompt_tokens_details.cached_tokens`` reports the prompt tokens
whose KV was restored (static prefix or an earlier prompt of the conversation), in the
request's own namespace only. A client that goes away cancels the
engine request (closing the engine's async iterator does that).

Not supported: ``n`` > 1 and ``logprobs`` (refused with a 400); tool calls come back as text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from prefix_cache.http.errors import BadRequest, ClientDisconnected, error_body
from prefix_cache.http.relay import until_disconnect
from prefix_cache.render import unwrap_tokenizer

from .mlx_engine import EngineError, GenerationRequest
from .mlx_engine.request import ContextLengthError

DEFAULT_MAX_TOKENS = 512
MAX_STOP_STRINGS = 4
REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens; past that a trailing
# U+FFFD is the model's own output, not a character still being assembled.
MAX_HELD_TOKENS = 6


# -- decoding --------------------------------------------------------------------------------


class IncrementalDecoder:
    """Text of a growing list of token ids, as deltas that never split a character.

    Each step decodes a short window (the last emitted token(s) plus the new ones) and emits
    what the new ids added; while the window's text ends in U+FFFD (an incomplete UTF-8
    sequence) nothing is emitted, for up to ``MAX_HELD_TOKENS`` tokens. ``flush`` emits what is
    left. The deltas concatenated equal ``decode(all ids)``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = unwrap_tokenizer(tokenizer)
        self._ids: list[int] = []
        self._prefix = 0   # window start: the tokens before it are emitted and stay emitted
        self._read = 0     # tokens up to here are emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def add(self, token: int) -> str:
        self._ids.append(int(token))
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        held = len(self._ids) - self._read
        if not final and text.endswith(REPLACEMENT) and held < MAX_HELD_TOKENS:
            return ""
        if len(text) <= len(before) and not final:
            return ""  # a window that decodes no longer (yet): wait for the next token
        delta = text[len(before):] if len(text) > len(before) else ""
        self._prefix, self._read = self._read, len(self._ids)
        return delta


def _stop_hold(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that some stop string starts with."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


# -- parameters ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatParams:
    """The sampling and output parameters of one OpenAI chat body, checked."""

    model: str
    max_tokens: int | None         # None: the engine's default, cut to the context left
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    specprefill: bool | None = None
    specprefill_keep_pct: float | None = None
    specprefill_threshold: int | None = None


def _int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{name} must be an integer >= {minimum}, got {value!r}",
                         code="invalid_value")
    return value


def _float(body: Mapping[str, Any], name: str, low: float, high: float,
           low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (low < value if low_open else low <= value) or value > high:
        bound = "(" if low_open else "["
        raise BadRequest(f"{name} must be a number in {bound}{low}, {high}], got {value!r}",
                         code="invalid_value")
    return float(value)


def _bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean, got {value!r}", code="invalid_value")
    return value


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS \
            or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} "
                         "strings", code="invalid_value")
    return tuple(s for s in stops if s)


# -- the chat engine -------------------------------------------------------------------------


@dataclass
class _Outcome:
    """What one completion came to (filled in while it runs)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    pieces: list[str] = field(default_factory=list)

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class ChatEngine:
    """OpenAI chat completions on one engine (an ``MLXEngine``, or anything with its
    ``agenerate``, ``vocab_size``, ``stop_token_ids``, ``snapshot_stats`` and ``close``)."""

    def __init__(self, engine: Any, tokenizer: Any | None = None, *, name: str = "model",
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("the chat engine needs the model's tokenizer to decode text")
        self.name = name
        self.default_max_tokens = default_max_tokens
        self._closed = False

    @classmethod
    def load(cls, model_dir: str | Path, draft_dir: str | Path | None = None, *,
             name: str | None = None, **options: Any) -> ChatEngine:
        """An engine for an mlx-lm model folder (and optionally a SpecPrefill draft); local
        folders only (mlx-lm would take a missing one for a Hub id and download it)."""
        from .mlx_engine import MLXEngine

        for folder in (model_dir, draft_dir):
            if folder is not None and not Path(folder).is_dir():
                raise ValueError(f"model folder {str(folder)!r} does not exist")

        engine = MLXEngine.load(model_dir, draft_dir, **options)
        return cls(engine, name=name or Path(model_dir).resolve().name)

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.engine, "vocab_size", None)

    @property
    def context_length(self) -> int | None:
        return getattr(self.engine, "context_length", None)

    def parse(self, body: Mapping[str, Any]) -> ChatParams:
        """The parameters of an OpenAI chat body; BadRequest naming the first bad one."""
        n = _int(body, "n", 1)
        if n not in (None, 1):
            raise BadRequest("n > 1 is not supported by this engine", code="unsupported_parameter")
        if body.get("logprobs"):
            raise BadRequest("logprobs are not supported by this engine",
                             code="unsupported_parameter")
        max_tokens = _int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", 1)
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", code="invalid_value")
        model = body.get("model")
        temperature = _float(body, "temperature", 0.0, 2.0)
        top_p = _float(body, "top_p", 0.0, 1.0, low_open=True)
        return ChatParams(
            model=model if isinstance(model, str) and model else self.name,
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            seed=_int(body, "seed", 0),
            stop=_stops(body.get("stop")),
            stream=bool(_bool(body, "stream")),
            include_usage=bool(_bool(options or {}, "include_usage")),
            specprefill=_bool(body, "specprefill"),
            specprefill_keep_pct=_float(body, "specprefill_keep_pct", 0.0, 1.0, low_open=True),
            specprefill_threshold=_int(body, "specprefill_threshold", 0),
        )

    def request(self, params: ChatParams, prompt_ids: Sequence[int], specprefill_system_end: int,
                namespace: str) -> GenerationRequest:
        """The engine request; BadRequest when the ids, the boundary or the lengths do not
        fit. A request that names no max_tokens gets the default, cut to the context left;
        one that names too many is refused, as OpenAI's API does."""
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens
            window = self.context_length
            if window is not None and len(prompt_ids) < window:
                max_tokens = min(max_tokens, window - len(prompt_ids))
        request = GenerationRequest(
            prompt_ids=list(prompt_ids), max_tokens=max_tokens,
            specprefill_system_end=specprefill_system_end, namespace=namespace,
            temperature=params.temperature, top_p=params.top_p, seed=params.seed,
            specprefill=params.specprefill, specprefill_keep_pct=params.specprefill_keep_pct,
            specprefill_threshold=params.specprefill_threshold,
        )
        try:
            request.validate(self.vocab_size, self.context_length)
        except ContextLengthError as exc:
            raise BadRequest(str(exc), code="context_length_exceeded") from exc
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc), code="invalid_request") from exc
        return request

    # -- running ----------------------------------------------------------------------------

    async def _pieces(self, params: ChatParams, request: GenerationRequest,
                      out: _Outcome) -> AsyncGenerator[str, None]:
        """Text deltas of the completion; ``out`` holds usage and the finish reason at the end."""
        out.prompt_tokens = len(request.prompt_ids)
        decoder = IncrementalDecoder(self.tokenizer)
        stop_ids = set(request.stop_token_ids if request.stop_token_ids is not None
                       else getattr(self.engine, "stop_token_ids", ()))
        pending = ""
        async with aclosing(self.engine.agenerate(request)) as events:
            async for event in events:
                out.completion_tokens += 1
                if event.prefill is not None:
                    out.cached_tokens = event.prefill.reused_tokens
                if not (event.finish_reason == "stop" and event.token in stop_ids):
                    pending += decoder.add(event.token)
                if event.finish_reason is not None:
                    pending += decoder.flush()
                if params.stop:
                    cut = min((i for i in (pending.find(s) for s in params.stop) if i >= 0),
                              default=-1)
                    if cut >= 0:  # leaving the loop closes the iterator: the engine stops
                        if cut:
                            yield pending[:cut]
                        out.finish_reason = "stop"
                        return
                    if event.finish_reason is None:
                        keep = _stop_hold(pending, params.stop)
                        ready, pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
                        if ready:
                            yield ready
                        continue
                if pending:
                    yield pending
                    pending = ""
                if event.finish_reason is not None:
                    out.finish_reason = event.finish_reason
                    return

    async def complete(self, params: ChatParams, request: GenerationRequest) -> dict[str, Any]:
        """A whole ``chat.completion``."""
        out = _Outcome()
        text = "".join([piece async for piece in self._pieces(params, request, out)])
        return {
            "id": f"chatcmpl-{request.request_id}", "object": "chat.completion",
            "created": int(time.time()), "model": params.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": out.finish_reason or "length"}],
            "usage": out.usage(),
        }

    async def stream(self, params: ChatParams, request: GenerationRequest) -> AsyncIterator[bytes]:
        """SSE events: ``data: {chat.completion.chunk}`` ... ``data: [DONE]``."""
        base = {"id": f"chatcmpl-{request.request_id}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": params.model}

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            data = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}], **extra}
            return b"data: " + orjson.dumps(data) + b"\n\n"

        out = _Outcome()
        yield chunk({"role": "assistant", "content": ""})
        try:
            async with aclosing(self._pieces(params, request, out)) as pieces:
                async for piece in pieces:
                    yield chunk({"content": piece})
        except EngineError as exc:  # the status is long sent: end the stream with the reason
            event = error_body(str(exc), "server_error", "engine_error")
            yield b"data: " + orjson.dumps(event) + b"\n\n"
            return
        yield chunk({}, out.finish_reason or "length")
        if params.include_usage:
            data = {**base, "choices": [], "usage": out.usage()}
            yield b"data: " + orjson.dumps(data) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def respond(self, http_request: Request, params: ChatParams,
                      request: GenerationRequest, headers: Mapping[str, str] | None = None,
                      ) -> Response:
        """The HTTP response; a client that disconnects cancels the engine request."""
        headers = dict(headers or {})
        if params.stream:
            # Starlette cancels the body iterator when the client disconnects; the engine's
            # iterator is closed with it, and closing it cancels the request.
            headers["x-accel-buffering"] = "no"
            return StreamingResponse(self.stream(params, request),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", **headers})
        try:
            completion, disconnected = await until_disconnect(http_request.receive,
                                                              self.complete(params, request))
        except EngineError as exc:
            return Response(orjson.dumps(error_body(str(exc), "server_error", "engine_error")),
                            status_code=500, media_type="application/json", headers=headers)
        if disconnected or completion is None:
            raise ClientDisconnected("the client disconnected before the completion was done")
        return Response(orjson.dumps(completion), media_type="application/json", headers=headers)

    # -- lifecycle --------------------------------------------------------------------------

    def snapshot_stats(self) -> dict[str, Any]:
        return dict(self.engine.snapshot_stats())

    def health(self) -> dict[str, Any]:
        """``{"ok": bool, ...}``: the engine's own report where it has one; closed is not ok."""
        probe = getattr(self.engine, "health", None)
        report = dict(probe()) if callable(probe) else {"ok": True}
        report["ok"] = bool(report.get("ok")) and not self._closed
        return report

    def close(self) -> None:
        """Stop the engine (once; later calls do nothing)."""
        if not self._closed:
            self._closed = True
            self.engine.close()

"""The MLX engine as a ``ChatBackend``: a neutral request in, text deltas out.

    BackendRequest ──> check: an MLXRequest, made once: max_tokens filled in (the default, cut
                       to the context left), the engine's GenerationRequest checked for its
                       limits (400s: ids, boundary, lengths, a grammar that cannot compile)
                   ──> generate (the MLXRequest): MLXEngine.agenerate token events ──> IncrementalDecoder ──>
                       stop strings ──> reasoning cut out (``<think>`` families:
                       ``reasoning``) ──> tool calls cut out (when the request gives tools and
                       the tokenizer knows its family's format: ``tool_calls``) ──>
                       BackendOutput deltas, usage on the last one

A request whose output is bound (``response_format``, ``tool_choice``; and ``auto`` with tools,
so a call once started is finished under its schema) runs under a grammar (``grammar``):
compiled once per namespace, grammar and tokenizer, a fresh matcher per request, checked (a 400
naming the part that cannot compile, or what the grammar would refuse) before anything runs.

The model's end-of-turn tokens end a generation with ``"stop"`` and are not returned as text;
closing the output iterator closes the engine's, which cancels the request.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prefix_cache.engine.protocol import (
    BackendError,
    BackendOutput,
    BackendRequest,
    EngineHealth,
    EngineStats,
    ToolCall,
    ToolCallChunk,
    Usage,
)

from .call_stream import StreamedCalls
from .decoding import IncrementalDecoder, StopStrings
from .defaults import DEFAULT_MAX_TOKENS
from .grammar import GrammarCache, GrammarRun, OutputGrammar, output_grammar
from .mlx_engine.request import GenerationRequest
from .reasoning import Reasoning, ReasoningSplitter, opens_inside, think_markers
from .families import NATIVE, call_format
from .grammar.build import Envelope
from .tool_calls import CallGaps, ToolCallSplitter, added_token, json_envelope, marker_ids


@dataclass(frozen=True, slots=True)
class MLXRequest:
    """A request as ``MLXBackend`` runs it (its ``CheckedBackendRequest``), made once by
    ``check``: what the text side reads (``request``: stop strings, tools, constraints; its
    max_tokens filled in), the engine's request checked for the engine's limits (``engine``,
    with its grammar's run) and the output grammar, which also says how tool calls are cut out
    of the text."""

    request: BackendRequest
    engine: GenerationRequest
    grammar: OutputGrammar | None


class MLXBackend:
    """Generation on one engine (an ``MLXEngine``, or anything with its ``agenerate``,
    ``vocab_size``, ``context_length``, ``stop_token_ids``, ``snapshot_stats`` and ``close``)."""

    constrained_decoding = True

    def __init__(self, engine: Any, tokenizer: Any | None = None, *, name: str = "model",
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("the backend needs the model's tokenizer to decode text")
        self.name = name
        self.default_max_tokens = default_max_tokens
        self._closed = False
        self.calls = call_format(self.tokenizer)
        self.envelope = json_envelope(self.tokenizer)
        self.think = think_markers(self.tokenizer)
        # Markers the text is read by are decoded as text, even where the tokenizer marks them
        # special (decoding would drop them, and a call or reasoning would pass as answer).
        self._keep = tuple(i for i in ((self.envelope.ids if self.envelope else ())
                                       + marker_ids(self.tokenizer, self.calls)
                                       + (self.think.ids if self.think else ()))
                           if i is not None)
        self._think_envelope = (Envelope(self.think.start, self.think.end, (
            added_token(self.tokenizer, self.think.start),
            added_token(self.tokenizer, self.think.end))) if self.think else None)
        # A complete grammar allows only the tokens that end the turn: the engine's stops.
        eos = tuple(getattr(engine, "stop_token_ids", ())) or _eos_ids(self.tokenizer)
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size or len(self.tokenizer), eos)

    @classmethod
    def load(cls, model_dir: str | Path, draft_dir: str | Path | None = None, *,
             name: str | None = None, **options: Any) -> MLXBackend:
        """A backend for an mlx-lm model folder (and optionally a SpecPrefill draft); local
        folders only (mlx-lm would take a missing one for a Hub id and download it)."""
        for folder in (model_dir, draft_dir):
            if folder is not None and not Path(folder).is_dir():
                raise ValueError(f"model folder {str(folder)!r} does not exist")
        from .mlx_engine import MLXEngine

        default_max_tokens = options.pop("default_max_tokens", DEFAULT_MAX_TOKENS)
        engine = MLXEngine.load(model_dir, draft_dir, **options)
        backend = cls(engine, name=name or Path(model_dir).resolve().name,
                      default_max_tokens=default_max_tokens)
        # A served model's first request with tools would otherwise build the grammar's
        # tokenizer (~0.4 s for a 49k vocabulary; bench/agent_loop.py's first tool turn).
        backend.grammars.prepare()
        return backend

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.engine, "vocab_size", None)

    @property
    def context_length(self) -> int | None:
        return getattr(self.engine, "context_length", None)

    # -- the ChatBackend protocol ------------------------------------------------------------

    def check(self, request: BackendRequest) -> MLXRequest:
        """The request as it will run, with its max_tokens; InvalidRequestError
        (ContextLengthError when the lengths do not fit) otherwise. A request that names no
        max_tokens gets the default, cut to the context left; one that names too many is
        refused, as OpenAI's API does. The engine's request is made and checked here, once,
        with its grammar's run (compiled once per grammar): ``generate`` runs it as it is."""
        max_tokens = request.sampling.max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens
            window = self.context_length
            if window is not None and len(request.prompt_ids) < window:
                max_tokens = min(max_tokens, window - len(request.prompt_ids))
        checked = replace(request, sampling=replace(request.sampling, max_tokens=max_tokens))
        grammar = self._grammar(checked)
        run = (self.grammars.run(grammar, request.namespace)  # or refused
               if grammar is not None else None)
        engine = self._engine_request(checked, run).checked(self.vocab_size, self.context_length)
        return MLXRequest(checked, engine, grammar)

    def _grammar(self, request: BackendRequest) -> OutputGrammar | None:
        """The request's grammar. Under ``auto`` a family whose own format the grammar does not
        write (Llama 3.x, DeepSeek: forced calls go in the engine's envelope) writes freely,
        and its parser reads its calls."""
        c = request.constraints
        envelope = self.envelope
        if (self.calls is not None and self.calls.forced != NATIVE and not c.binding
                and c.tool_choice in (None, "auto")):
            envelope = None
        return output_grammar(c, request.tools, envelope, self._think_envelope)

    def _splitter(self, request: BackendRequest,
                  grammar: OutputGrammar | None) -> ToolCallSplitter | StreamedCalls | None:
        """What cuts tool calls out of the text: the grammar's envelope when it writes them,
        else the model family's parser (none when the client said tool_choice "none")."""
        if (grammar is not None and grammar.calls and self.envelope is not None
                and not self.envelope.bare):
            return StreamedCalls(self.envelope)  # the grammar's shape: streamed as written
        if request.constraints.tool_choice == "none":
            return None
        return ToolCallSplitter.for_format(self.calls, request.tools)

    async def generate(self, checked: MLXRequest) -> AsyncGenerator[BackendOutput, None]:
        request, grammar, run = checked.request, checked.grammar, checked.engine.grammar
        decoder = IncrementalDecoder(self.tokenizer, self._keep)
        stops = StopStrings(request.sampling.stop)
        # A bound output (a forced call, a JSON format) is written from its first token: no
        # reasoning before it.
        thinking = (None if self.think is None or request.constraints.binding
                    else ReasoningSplitter(self.think, opens_inside(
                        self.tokenizer, request.prompt_ids, self.think)))
        calls = self._splitter(request, grammar)
        gaps = CallGaps()
        stop_ids = set(getattr(self.engine, "stop_token_ids", ()))
        generated = cached = 0
        async with aclosing(self.engine.agenerate(checked.engine)) as events:
            async for event in events:
                generated += 1
                if event.prefill is not None:
                    cached = event.prefill.reused_tokens
                    if event.finish_reason is None:  # the prompt's counts, before any text
                        yield BackendOutput(usage=Usage(len(request.prompt_ids), 0, cached))
                text = ""
                if not (event.finish_reason == "stop" and event.token in stop_ids):
                    text = decoder.add(event.token)
                final = event.finish_reason is not None
                if final:
                    text += decoder.flush()
                text, stopped = stops.feed(text, final)
                done = stopped or final
                pieces: list[Any] = [text] if thinking is None else thinking.feed(text, done)
                if calls is not None:
                    answer = "".join(p for p in pieces if isinstance(p, str))
                    pieces = [p for p in pieces if isinstance(p, Reasoning)]
                    pieces += gaps(calls.feed(answer, done), done)
                last = ""
                if done and pieces and isinstance(pieces[-1], str):
                    last = str(pieces.pop())  # the last text goes with the finish, as before
                for piece in pieces:
                    if isinstance(piece, Reasoning):
                        yield BackendOutput(reasoning=piece.text)
                    elif isinstance(piece, ToolCall):
                        yield BackendOutput(tool_calls=(piece,))
                    elif isinstance(piece, ToolCallChunk):
                        yield BackendOutput(tool_call_chunks=(piece,))
                    elif piece:
                        yield BackendOutput(piece)
                if done and run is not None and run.error is not None:
                    raise BackendError(f"the output left its grammar: {run.error}")
                if done:  # leaving the loop closes the engine's iterator
                    finish = "stop" if stopped else event.finish_reason
                    if finish == "stop" and not stopped and calls is not None and calls.calls:
                        finish = "tool_calls"  # the turn ended after its tool calls
                    usage = Usage(len(request.prompt_ids), generated, cached)
                    yield BackendOutput(last, finish, usage, stop_sequence=stops.matched)
                    return

    def _engine_request(self, request: BackendRequest,
                        grammar: GrammarRun | None) -> GenerationRequest:
        s, sp = request.sampling, request.specprefill
        return GenerationRequest(
            prompt_ids=request.prompt_ids, max_tokens=s.max_tokens or 0,
            specprefill_system_end=request.specprefill_system_end,
            namespace=request.namespace, temperature=s.temperature, top_p=s.top_p,
            seed=s.seed, specprefill=sp.enabled, specprefill_keep_pct=sp.keep_pct,
            specprefill_threshold=sp.threshold, request_id=request.request_id,
            grammar=grammar,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    def snapshot_stats(self) -> EngineStats:
        stats: EngineStats = self.engine.snapshot_stats()
        return stats

    def purge_kv(self, namespace: str | None = None) -> int:
        """Drop a namespace's KV (or all) from the engine's stores, RAM and disk, and its
        compiled grammars (the admin purge); the KV entries dropped."""
        self.grammars.purge(namespace)
        stores = (getattr(self.engine, "kv_store", None),
                  getattr(self.engine, "conversation_store", None))
        return sum(s.purge(namespace) for s in stores if s is not None)

    def health(self) -> EngineHealth:
        """The engine's own report where it has one; closed is not ok."""
        probe = getattr(self.engine, "health", None)
        report = EngineHealth(**probe()) if callable(probe) else EngineHealth(ok=True)
        report["ok"] = bool(report.get("ok")) and not self._closed
        return report

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (read-only)."""
        return self._closed

    def close(self) -> None:
        """Stop the engine (once; later calls do nothing)."""
        if not self._closed:
            self._closed = True
            self.engine.close()


def _eos_ids(tokenizer: Any) -> tuple[int, ...]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple, set)) else (int(ids),)

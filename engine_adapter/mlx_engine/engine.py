"""The batched engine: continuous batching on mlx-lm's BatchGenerator, with the static prefix's
KV reused across requests and SpecPrefill on the rest of long prompts.

    submit(request) ──> engine thread: admit ──> BatchGenerator.insert ──> next() ──> events
    admit, dense:       KV of [0, boundary) in the store?  hit:  insert(rest, caches=[restored])
                                                            miss: insert_segments([static, rest]),
                                                                  snapshot at the segment's end
    admit, dense, with a conversation prefix: the stored prompt of this namespace sharing
                        the longest prefix with the new one (a previous turn it extends, or a
                        sibling) is restored up to that shared length instead; every dense
                        request stores its own prompt minus the last token once its first
                        token is out
    admit, SpecPrefill: static part restored or dense (and stored), draft scores the rest, the
                        target prefills the kept tokens at their positions, insert([last token])

Everything that touches the models runs on the engine's one thread; callers get tokens through
a callback, a blocking iterator (``generate``) or an async iterator (``agenerate``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from prefix_cache.chat.backend import EngineStats

from ..options import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_PREFILL_BATCH_SIZE,
    DEFAULT_PREFILL_STEP,
)
from . import cache as kv
from .kv_store import Key, StaticKVStore, prefix_key
from .prefill import dense_prefill_steps, sparse_prefill_steps
from .request import (
    DENSE,
    SPECPREFILL,
    EngineError,
    GenerationRequest,
    PrefillInfo,
    TokenEvent,
)
from .sampling import make_sampler
from .specprefill import SpecPrefillConfig, score_steps, select_chunks

log = logging.getLogger("engine_adapter.mlx_engine")

Deliver = Callable[[Any], None]  # gets TokenEvents, then possibly one exception
TARGET_ID, DRAFT_ID = "target", "draft"


@dataclass(slots=True)
class _Sequence:
    request: GenerationRequest
    deliver: Deliver
    submitted: float
    sampler: Any
    uid: int | None = None
    emitted: int = 0
    info: PrefillInfo | None = None
    snapshot_at: int = 0       # >0: store the KV of [0, snapshot_at) when that segment is done
    conversation_at: int = 0   # >0: store [0, conversation_at) (prompt - 1) in the conversation store
    conversation_ready: bool = False  # that segment is prefilled: store it after the first token
    base: int = 0              # tokens restored before insertion (BatchGenerator's progress is after them)
    # Prompt positions of the tokens stored for [0, base) when some were dropped (a SpecPrefill's
    # KV, or a restore of one); None: dense, all of them.
    stored_positions: tuple[int, ...] | None = None
    leads: Key | None = None   # the static prefix this request computes for parked followers
    parked_on: Key | None = None
    may_park: bool = True


@dataclass(slots=True)
class _SparseJob:
    """A SpecPrefill in progress: one model chunk per engine step, between decode steps."""

    seq: _Sequence
    ids: list[int]
    static: int
    steps: Generator[None, None, None]


@dataclass(slots=True)
class EngineCounters:
    """Counters since the engine started (``snapshot_stats()`` reads them)."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    specprefill: int = 0
    fallbacks: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    parked: int = 0            # waited for a request computing the same static prefix
    conversation_hits: int = 0  # restored more than the static prefix from an earlier prompt
    last_fallback: str | None = None


def vocab_size(model: Any) -> int | None:
    """The model's vocabulary size when its config says it."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


# RoPE scalings whose factor stretches ``max_position_embeddings`` (Qwen's YaRN recipe leaves
# that field at the trained length); llama3 and longrope configs already state the full window.
_STRETCHING_ROPE = {"yarn", "linear", "dynamic"}


def context_length(model: Any) -> int | None:
    """The model's context window when its config says it: ``max_position_embeddings``, times
    the RoPE scaling factor for scalings that extend it (as vLLM reads it)."""
    args = getattr(model, "args", None)
    size = getattr(args, "max_position_embeddings", None)
    if not isinstance(size, int) or size <= 0:
        return None
    scaling = getattr(args, "rope_scaling", None)
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        factor = scaling.get("factor")
        if kind in _STRETCHING_ROPE and isinstance(factor, (int, float)) and factor > 1:
            size = int(size * factor)
    return size


class MLXEngine:
    """A batched MLX engine for one target model (and optionally a SpecPrefill draft)."""

    def __init__(
        self,
        model: Any,
        *,
        draft_model: Any | None = None,
        kv_store: StaticKVStore | None = None,
        reuse_static_kv: bool = True,
        conversation_store: StaticKVStore | None = None,
        reuse_conversation_kv: bool = True,
        reuse_sparse_kv: bool = True,
        specprefill: SpecPrefillConfig | None = None,
        stop_token_ids: Sequence[int] = (),
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        prefill_batch_size: int = DEFAULT_PREFILL_BATCH_SIZE,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        tokenizer: Any | None = None,
        max_context: int | None = None,
    ) -> None:
        if max_context is not None and max_context < 2:
            raise ValueError(f"max_context must be >= 2 tokens, got {max_context}")
        if max_batch_size < 1 or prefill_batch_size < 1 or prefill_step_size < 1:
            raise ValueError("max_batch_size, prefill_batch_size and prefill_step_size "
                             "must be >= 1")
        self.model = model
        self.draft_model = draft_model
        self.tokenizer = tokenizer
        self.kv_store: StaticKVStore | None = None
        if reuse_static_kv:
            self.kv_store = kv_store if kv_store is not None else StaticKVStore()
        # Conversation prefixes: each dense request's prompt (minus its last token) per
        # namespace; a later prompt restores the longest prefix it shares with one
        # (mlx_lm.server's prompt cache, but namespaced and bounded in bytes like the static
        # store).
        self.conversation_store: StaticKVStore | None = None
        if reuse_conversation_kv:
            self.conversation_store = (conversation_store if conversation_store is not None
                                       else StaticKVStore())
        # A SpecPrefill's KV (its kept tokens, at their positions) goes to the conversation store
        # too, so the next turn restores it and computes only what is new, instead of scoring
        # and sparsifying the same history again (it sees that history as this turn did).
        self.reuse_sparse_kv = reuse_sparse_kv
        self.specprefill = specprefill or SpecPrefillConfig()
        self.stop_token_ids = tuple(stop_token_ids)
        self.vocab_size = vocab_size(model)
        # Prompt plus generated tokens may not pass the context window: beyond it RoPE models
        # degrade and a sequence's KV would grow without bound (the memory of every other one).
        # ``max_context`` lowers the model's window (never raises it) to bound KV memory.
        window = context_length(model)
        self.context_length = (max_context if window is None
                               else min(window, max_context or window))
        self.stats = EngineCounters()
        self._positioned = kv.supports_positioned_cache(model)
        self._batch = (max_batch_size, prefill_batch_size, prefill_step_size)
        self._step_size = prefill_step_size
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._by_id: dict[str, _Sequence] = {}
        self._by_uid: dict[int, _Sequence] = {}
        # Single flight per static prefix: while one request prefills it, later ones with the
        # same (namespace, prefix ids) wait here and then restore it instead of recomputing.
        self._computing: dict[Key, list[_Sequence]] = {}
        # SpecPrefills in progress, oldest first; the engine advances the oldest by one model
        # chunk per loop, between BatchGenerator steps, so running sequences keep decoding.
        self._sparse_jobs: deque[_SparseJob] = deque()
        self._generator: BatchGenerator  # made on the engine thread (mlx streams are per thread)
        self._start_error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise EngineError("the engine thread could not start") from self._start_error

    @classmethod
    def load(cls, model_dir: str | Path, draft_dir: str | Path | None = None,
             **options: Any) -> MLXEngine:
        """An engine for an mlx-lm model folder (and a draft folder with the same vocabulary)."""
        from mlx_lm import load

        loaded = load(str(model_dir))
        model, tokenizer = loaded[0], loaded[1]
        draft = load(str(draft_dir))[0] if draft_dir is not None else None
        options.setdefault("stop_token_ids", sorted(tokenizer.eos_token_ids))
        return cls(model, draft_model=draft, tokenizer=tokenizer, **options)

    # -- the caller's side ------------------------------------------------------------------

    def submit(self, request: GenerationRequest, deliver: Deliver) -> None:
        """Queue a request; ``deliver`` gets its TokenEvents (or one exception) on the engine
        thread, and must not block."""
        request.validate(self.vocab_size, self.context_length)
        sampler = make_sampler(request.temperature, request.top_p, request.seed)
        seq = _Sequence(request, deliver, time.perf_counter(), sampler)
        self._post("submit", seq)

    def cancel(self, request_id: str) -> None:
        """Stop a request early; its consumer gets nothing more."""
        self._post("cancel", request_id)

    def generate(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        """Tokens of one request as they come (blocking); closing the iterator cancels it."""
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.submit(request, events.put)
        done = False
        try:
            while not done:
                item = events.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
        finally:
            if not done:
                self.cancel(request.request_id)

    async def agenerate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Tokens of one request as they come, for asyncio (a FastAPI streaming response)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()

        def deliver(item: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        self.submit(request, deliver)
        done = False
        try:
            while not done:
                item = await events.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
        finally:
            if not done:
                self.cancel(request.request_id)

    def health(self) -> dict[str, Any]:
        """Whether the engine thread is up to take requests, and how busy it is (what a
        readiness probe reports)."""
        return {"ok": self._thread.is_alive() and not self._closed,
                "active": len(self._by_id), "queued": len(self._inbox),
                "sparse_prefills": len(self._sparse_jobs)}

    def snapshot_stats(self) -> EngineStats:
        """Engine and KV-store figures now."""
        kv, conv = self.kv_store, self.conversation_store
        return EngineStats(
            **{f.name: getattr(self.stats, f.name) for f in fields(EngineCounters)},
            active=len(self._by_id),
            kv_store=kv.snapshot_stats() if kv is not None else None,
            conversation_store=conv.snapshot_stats() if conv is not None else None)

    def close(self) -> None:
        """Finish the engine thread; requests still running get an EngineError."""
        self._post("close", None)
        self._thread.join()

    def __enter__(self) -> MLXEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, kind: str, item: Any) -> None:
        with self._wake:
            if self._closed:
                raise EngineError("the engine is closed")
            if kind == "close":
                self._closed = True
            self._inbox.append((kind, item))
            self._wake.notify()

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._generator = self._new_generator()
        except BaseException as exc:
            self._start_error = exc
            return
        finally:
            self._ready.set()
        while True:
            with self._wake:
                # (parked requests wait on a leader, so they alone are no work)
                while not self._inbox and not self._by_uid and not self._sparse_jobs:
                    self._wake.wait()
                work = list(self._inbox)
                self._inbox.clear()
            for kind, item in work:
                if kind == "submit":
                    self._admit(item)
                elif kind == "cancel":
                    self._drop(item)
                else:
                    self._fail_all(EngineError("the engine was closed"))
                    self._generator.close()
                    return
            if self._sparse_jobs:
                self._advance_sparse()
            if self._by_uid:
                try:
                    self._step()
                except Exception as exc:  # a failed model step fails what was running, not the engine
                    log.exception("engine step failed")
                    self._fail_all(EngineError(f"model step failed: {exc}"))
                    self._generator.close()
                    self._generator = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        max_batch, prefill_batch, step = self._batch
        return BatchGenerator(
            self.model, stop_tokens=[[t] for t in self.stop_token_ids] or None,
            completion_batch_size=max_batch, prefill_batch_size=prefill_batch,
            prefill_step_size=step,
        )

    def _step(self) -> None:
        prompt_responses, responses = self._generator.next()
        for r in prompt_responses:
            seq = self._by_uid.get(r.uid)
            if seq is None or not r.end_of_segment:
                continue
            done = seq.base + r.progress[0]
            if done == seq.snapshot_at and done > 0:
                self._store_segment(seq, done)
            elif done == seq.conversation_at and done > 0:
                # Copying the prompt's KV now would delay the first token; the sequence keeps
                # that KV, so it is stored right after the first token is delivered.
                seq.conversation_ready = True
        for r in responses:
            seq = self._by_uid.get(r.uid)
            if seq is not None:
                self._emit(seq, r)

    def _emit(self, seq: _Sequence, r: Any) -> None:
        first = seq.emitted == 0
        event = TokenEvent(
            seq.request.request_id, int(r.token), seq.emitted, r.finish_reason,
            time.perf_counter() - seq.submitted,
            r.logprobs if seq.request.return_logprobs else None,
            seq.info if first else None,
        )
        seq.emitted += 1
        self.stats.generated_tokens += 1
        if r.finish_reason is not None:
            self._forget(seq)
            self.stats.completed += 1
        self._send(seq, event)
        if seq.conversation_ready:
            self._store_conversation(seq, r)

    def _send(self, seq: _Sequence, item: Any) -> None:
        try:
            seq.deliver(item)
        except Exception:  # a consumer that went away (closed event loop) must not stop the engine
            log.warning("could not deliver to request %s", seq.request.request_id, exc_info=True)

    def _forget(self, seq: _Sequence) -> None:
        self._by_id.pop(seq.request.request_id, None)
        if seq.uid is not None:
            self._by_uid.pop(seq.uid, None)
        if seq.parked_on is not None:
            waiting = self._computing.get(seq.parked_on, [])
            if seq in waiting:
                waiting.remove(seq)
            seq.parked_on = None
        if seq.leads is not None:  # gone before its static prefix was stored: let another lead
            self._release(seq, stored=False)

    def _release(self, leader: _Sequence, stored: bool) -> None:
        """Start the requests parked on ``leader``'s static prefix: they restore it if it was
        stored; if it could not be (too big for the store) they compute it side by side."""
        key, leader.leads = leader.leads, None
        for seq in self._computing.pop(key, []) if key is not None else []:
            seq.parked_on = None
            # Leader gone before storing: the first follower leads now, the others park on it.
            seq.may_park = stored or leader.request.request_id not in self._by_id
            self._start(seq)

    def _drop(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is None:
            return
        if seq.uid is not None:
            self._generator.remove([seq.uid])
        self._forget(seq)
        self.stats.cancelled += 1

    def _fail_all(self, exc: Exception) -> None:
        self._computing.clear()
        while self._sparse_jobs:
            self._sparse_jobs.popleft().steps.close()
        for seq in list(self._by_id.values()):
            seq.leads = seq.parked_on = None
            self._forget(seq)
            self.stats.failed += 1
            self._send(seq, exc)

    # -- admission: how a prompt gets into the KV cache ---------------------------------------

    def _admit(self, seq: _Sequence) -> None:
        req = seq.request
        if req.request_id in self._by_id:
            self._send(seq, EngineError(f"request id {req.request_id!r} is already running"))
            return
        self.stats.requests += 1
        self._by_id[req.request_id] = seq
        self._start(seq)

    def _start(self, seq: _Sequence) -> None:
        req = seq.request
        ids = list(req.prompt_ids)
        # The last prompt token is the one generation starts from: it is never part of a snapshot.
        static = min(req.specprefill_system_end, len(ids) - 1)
        # What an earlier prompt of this conversation left dense comes back whole; SpecPrefill
        # is for what is left to compute (as oMLX admits it after its prefix cache), so a long
        # conversation of short turns stays dense instead of re-sparsifying its history.
        conv = self._conversation_hit(req, ids, static)
        sparse = self._wants_specprefill(req, len(ids) - (conv[0] if conv else static))
        if static and self.kv_store is not None and self._positioned and seq.may_park \
                and conv is None:
            key = prefix_key(req.namespace, TARGET_ID, ids[:static])[0]
            if key in self._computing:
                self._computing[key].append(seq)
                seq.parked_on = key
                self.stats.parked += 1
                return
        if sparse:
            steps = self._sparse_steps(seq, ids, static, conv)
            self._sparse_jobs.append(_SparseJob(seq, ids, static, steps))
            return
        fallback = "no draft model" if req.specprefill and self.draft_model is None else None
        self._start_dense(seq, ids, static, fallback, conv)

    def _start_dense(self, seq: _Sequence, ids: list[int], static: int, fallback: str | None,
                     conv: tuple[int, Any] | None) -> None:
        try:
            with mx.stream(self._generator.stream):
                self._admit_dense(seq, ids, static, fallback, conv)
        except Exception as exc:
            log.exception("could not admit request %s", seq.request.request_id)
            self._forget(seq)
            self.stats.failed += 1
            self._send(seq, EngineError(f"could not start the request: {exc}"))

    def _advance_sparse(self) -> None:
        """One model chunk of the oldest SpecPrefill; at its end the sequence is in the batch.
        Any failure falls back to a dense prefill (same answer class, counted)."""
        job = self._sparse_jobs[0]
        if self._by_id.get(job.seq.request.request_id) is not job.seq:  # cancelled meanwhile
            self._sparse_jobs.popleft()
            job.steps.close()
            return
        try:
            with mx.stream(self._generator.stream):
                next(job.steps)
            return
        except StopIteration:
            self._sparse_jobs.popleft()
            return
        except Exception as exc:
            self._sparse_jobs.popleft()
            fallback = f"{type(exc).__name__}: {exc}"
        log.warning("SpecPrefill failed, dense prefill instead: %s", fallback)
        self.stats.fallbacks += 1
        self.stats.last_fallback = fallback
        conv = self._conversation_hit(job.seq.request, job.ids, job.static)
        self._start_dense(job.seq, job.ids, job.static, fallback, conv)

    def _wants_specprefill(self, req: GenerationRequest, rest: int) -> bool:
        if self.draft_model is None or not self._positioned or req.specprefill is False:
            return False
        threshold = req.specprefill_threshold
        return rest > (self.specprefill.threshold if threshold is None else threshold)

    def _conversation_hit(self, req: GenerationRequest, ids: list[int],
                          static: int) -> tuple[int, Any] | None:
        """(length, snapshot): the stored prompt of this namespace that shares the longest
        prefix with ``ids`` (an earlier turn it extends, or a sibling), when that shared part is
        longer than the static prefix; else None (the static path)."""
        if self.conversation_store is None or not self._positioned:
            return None
        hit = self.conversation_store.longest_common_prefix(req.namespace, TARGET_ID, ids,
                                                            len(ids) - 1, min_tokens=static)
        if hit is None:
            return None
        n, snap = hit
        if req.specprefill is False:
            # A request that turned SpecPrefill off gets exact attention over its whole prompt:
            # of a sparse entry only the part stored whole (its protected prefix) is restored.
            n = min(n, snap.dense_tokens)
            if n <= static:
                return None
        if snap.stored_before(n) == 0:
            return None  # a sparse entry that kept nothing of the shared part: nothing to restore
        return n, snap

    def _insert(self, seq: _Sequence, segments: list[list[int]], cache: list[Any]) -> None:
        req = seq.request
        stops = None
        if req.stop_token_ids is not None:
            stops = [StopSequences([[t] for t in req.stop_token_ids])]
        (seq.uid,) = self._generator.insert_segments(
            [segments], max_tokens=[req.max_tokens], caches=[cache],
            samplers=[seq.sampler], stop_sequences=stops,
        )
        self._by_uid[seq.uid] = seq

    def _admit_dense(self, seq: _Sequence, ids: list[int], static: int,
                     fallback: str | None, conv: tuple[int, Any] | None = None) -> None:
        req = seq.request
        reused = conversation = 0
        seq.stored_positions = None
        # The prompt minus its last token goes to the conversation store once it is prefilled.
        last = len(ids) - 1 if self.conversation_store is not None and self._positioned else 0
        if conv is not None:
            reused = conversation = seq.base = conv[0]
            seq.stored_positions = conv[1].positions_before(reused)
            seq.conversation_at = last if last > reused else 0
            self._insert(seq, [ids[reused:]], kv.restore(conv[1], reused, copy=False))
            self.stats.conversation_hits += 1
        elif self.kv_store is not None and self._positioned and static > 0:
            snap = self.kv_store.get(req.namespace, TARGET_ID, ids[:static])
            if snap is not None:
                reused = seq.base = static
                seq.conversation_at = last if last > static else 0
                self._insert(seq, [ids[static:]], kv.restore(snap, copy=False))
            else:
                seq.snapshot_at = static
                seq.conversation_at = last
                self._insert(seq, [ids[:static], ids[static:]], kv.make_cache(self.model))
                seq.leads = prefix_key(req.namespace, TARGET_ID, ids[:static])[0]
                self._computing.setdefault(seq.leads, [])
        else:
            seq.conversation_at = last
            self._insert(seq, [ids], kv.make_cache(self.model))
        seq.info = PrefillInfo(len(ids), static, reused, len(ids) - reused, DENSE,
                               fallback=fallback, conversation_tokens=conversation)
        self.stats.reused_tokens += reused
        self.stats.prefilled_tokens += len(ids) - reused

    def _store_segment(self, seq: _Sequence, n: int) -> None:
        static, conversation = n == seq.snapshot_at, n == seq.conversation_at
        if static:
            seq.snapshot_at = 0
        if conversation:
            seq.conversation_at = 0
        extracted = self._generator.extract_cache([seq.uid]).get(seq.uid)
        stored = False
        ids = seq.request.prompt_ids
        if extracted is None or kv.cache_size(extracted[0]) != n:
            log.warning("segment of %s not where expected; not stored", seq.request.request_id)
        else:
            snap = kv.snapshot(extracted[0], n)
            if static and self.kv_store is not None:
                stored = self.kv_store.put(seq.request.namespace, TARGET_ID, ids[:n], snap)
            if conversation and self.conversation_store is not None:
                # One snapshot object for both is fine: snapshots are never written to.
                self.conversation_store.put(seq.request.namespace, TARGET_ID, ids[:n], snap,
                                            supersede=True)
        if static and seq.leads is not None:
            self._release(seq, stored)

    def _store_conversation(self, seq: _Sequence, r: Any) -> None:
        """Store the prompt minus its last token in the conversation store, copied from the KV
        the sequence holds once its first token is out (the finished response's cache, or the
        running batch's); a failure here costs a later reuse, never this request."""
        n, seq.conversation_at, seq.conversation_ready = seq.conversation_at, 0, False
        store = self.conversation_store
        if store is None or n <= 0:
            return
        try:
            positions = seq.stored_positions
            if positions is not None:     # sparse: what was restored or kept, then all the rest
                positions = positions + tuple(range(seq.base, n))
            stored = n if positions is None else len(positions)
            cache = r.prompt_cache
            if cache is None:
                extracted = self._generator.extract_cache([seq.uid]).get(seq.uid)
                cache = extracted[0] if extracted is not None else None
            if cache is None or kv.cache_size(cache) < stored:
                log.warning("prompt KV of %s not there; not stored", seq.request.request_id)
                return
            snap = (kv.snapshot(cache, n) if positions is None
                    else kv.snapshot(cache, stored, positions=positions, span=n))
            store.put(seq.request.namespace, TARGET_ID, seq.request.prompt_ids[:n], snap,
                      supersede=True)
        except Exception:
            log.warning("could not store the prompt KV of %s", seq.request.request_id,
                        exc_info=True)

    def _static_cache_steps(self, model: Any, model_id: str, namespace: str, ids: list[int],
                            static: int) -> Generator[None, None, tuple[list[Any], int]]:
        """A per-sequence cache holding [0, static) and the tokens reused: restored, or
        computed chunk by chunk (and stored)."""
        if static and self.kv_store is not None:
            snap = self.kv_store.get(namespace, model_id, ids[:static])
            if snap is not None:
                return kv.restore(snap), static
        cache = kv.make_cache(model)
        if static:
            yield from dense_prefill_steps(model, ids[:static], cache, self._step_size)
            if self.kv_store is not None:
                self.kv_store.put(namespace, model_id, ids[:static], kv.snapshot(cache, static))
        return cache, 0

    def _sparse_steps(self, seq: _Sequence, ids: list[int], static: int,
                      conv: tuple[int, Any] | None = None) -> Generator[None, None, None]:
        """SpecPrefill of one request, a model chunk per step: the protected part restored or
        dense (the static prefix, or the longer prefix ``conv`` restores from an earlier prompt
        of the conversation), the draft's scores of what follows it, the kept tokens at their
        positions; then the sequence joins the batch with its last prompt token."""
        req = seq.request
        spec = self.specprefill
        draft_vocab = vocab_size(self.draft_model)
        if draft_vocab is not None and max(ids) >= draft_vocab:
            raise ValueError(f"token id {max(ids)} is outside the draft's vocabulary "
                             f"({draft_vocab})")
        n = len(ids)
        protected_positions: tuple[int, ...] | None = None
        if conv is not None:       # a copy: the sparse prefill writes after it
            protected = reused = conv[0]
            target = kv.restore(conv[1], protected)
            protected_positions = conv[1].positions_before(protected)
        else:
            protected = static
            target, reused = yield from self._static_cache_steps(self.model, TARGET_ID,
                                                                 req.namespace, ids, static)
        # The draft has no conversation KV: it reads the prompt from its static prefix on
        # (a twentieth of the target's cost) and scores only what follows the protected part.
        draft, _ = yield from self._static_cache_steps(self.draft_model, DRAFT_ID,
                                                       req.namespace, ids, static)
        importance = yield from score_steps(self.draft_model, ids, protected, draft,
                                            lookahead=spec.lookahead,
                                            pool_kernel=spec.pool_kernel, step=self._step_size)
        del draft
        keep_pct = req.specprefill_keep_pct or spec.keep_pct
        kept = select_chunks(importance, keep_pct, spec.chunk_size, spec.tail_tokens)
        # The final prompt token is generation's first input: BatchGenerator feeds it.
        positions = [protected + i for i in kept if protected + i != n - 1]
        yield from sparse_prefill_steps(self.model, ids, positions, target, self._step_size)
        shift = (n - 1) - kv.cache_size(target)
        for layer in target:
            layer.position_shift = shift
        self._insert(seq, [[ids[-1]]], target)
        if self.reuse_sparse_kv and self.conversation_store is not None and n > 1:
            # The prompt minus its last token is all in ``target``: stored after the first
            # token, as a dense prompt is (set once inserted: a failure before falls back to a
            # dense admission, which must not inherit any of it).
            seq.base = seq.conversation_at = n - 1
            seq.stored_positions = (protected_positions if protected_positions is not None
                                    else tuple(range(protected))) + tuple(positions)
            seq.conversation_ready = True
        computed = (protected - reused) + len(positions) + 1
        seq.info = PrefillInfo(n, static, reused, computed, SPECPREFILL,
                               kept_tokens=len(positions) + 1,
                               conversation_tokens=reused if conv is not None else 0)
        self.stats.specprefill += 1
        self.stats.conversation_hits += conv is not None
        self.stats.reused_tokens += reused
        self.stats.prefilled_tokens += computed

"""The batched engine: continuous batching on mlx-lm's BatchGenerator, with the static prefix's
KV reused across requests and SpecPrefill on the rest of long prompts.

    submit(request) ──> engine thread: admit ──> prefill job ──> BatchGenerator (decode)
    each step:          decode first, then the prefill chunks ``StepBudget.schedule`` picks
                        within the step's token budget, shared across namespaces (``budget``);
                        while a stream runs, about one decode step's time of them (``StepClock``)
    admit, dense:       what ``KVReuse.plan_dense`` restores (a conversation prefix, the static
                        prefix, or nothing), the rest computed in chunks (``ChunkedPrefill``);
                        the static prefix and the prompt are stored as their segments finish
                        (``reuse``); inserted into the batch with the last prompt token
    admit, SpecPrefill: a job (``sparse``) advanced one model chunk per budgeted step; its
                        cache is inserted with the last prompt token
    a request whose static prefix another one is computing waits for it (parked)
    ``fair_prefill=False``: first come first served instead (mlx-lm's own chunked prefill in
    the batch; SpecPrefill jobs oldest first, a chunk per loop)

Everything that touches the models runs on the engine's one thread; callers get tokens through
a callback, a blocking iterator (``generate``) or an async iterator (``agenerate``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx

from prefix_cache.engine.protocol import EngineCounts, EngineHealth, EngineStats, counted

from ..defaults import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_PREFILL_BATCH_SIZE,
    DEFAULT_PREFILL_STEP,
    DEFAULT_SPECULATIVE,
    DEFAULT_STEP_TOKENS,
)
from .kv import cache as kv_cache
from .budget import StepBudget, StepClock, finishes
from .delivery import async_events, blocking_events
from .draft_layers import reused_layers
from .kv.disk_setup import DiskKVStore, open_kv_disk
from .kv.store import KVSnapshotStore
from .kv.tiered import tiered
from .model_info import BatchGenerator, context_length, vocab_size
from .prefill import ChunkedPrefill, insert_sequence, new_batch_generator
from .request import (
    DENSE,
    SPECPREFILL,
    EngineError,
    GenerationRequest,
    PrefillInfo,
    TokenEvent,
)
from .reuse import ConversationHit, KVReuse, ReusePlan
from .sampling import request_sampler
from .sequence import Deliver, EngineSequence
from .specprefill_jobs import SparseJob, SparsePrefill, sparse_capable, specprefill_steps
from .specprefill import SpecPrefillConfig
from .speculative import Speculation, speculation_supported
from .mlx_streams import releasing_streams

log = logging.getLogger("engine_adapter.mlx_engine")

UNSUPPORTED_LAYERS = "SpecPrefill not supported: the model has sliding-window or recurrent layers"


class MLXEngine:
    """A batched MLX engine for one target model (and optionally a SpecPrefill draft)."""

    def __init__(
        self,
        model: Any,
        *,
        draft_model: Any | None = None,
        kv_store: KVSnapshotStore | None = None,
        reuse_static_kv: bool = True,
        conversation_store: KVSnapshotStore | None = None,
        reuse_conversation_kv: bool = True,
        reuse_sparse_kv: bool = True,
        reuse_reply_kv: bool = True,    # a finished sequence's reply too (``reply``)
        specprefill: SpecPrefillConfig | None = None,
        stop_token_ids: Sequence[int] = (),
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        prefill_batch_size: int = DEFAULT_PREFILL_BATCH_SIZE,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        tokenizer: Any | None = None,
        max_context: int | None = None,
        kv_disk: DiskKVStore | None = None,
        fair_prefill: bool = True,      # the step's token budget (``budget``); off: FCFS
        step_tokens: int = DEFAULT_STEP_TOKENS,
        speculative: bool = DEFAULT_SPECULATIVE,  # prompt-lookup drafts (``speculative``)
    ) -> None:
        if max_context is not None and max_context < 2:
            raise ValueError(f"max_context must be >= 2 tokens, got {max_context}")
        if max_batch_size < 1 or prefill_batch_size < 1 or prefill_step_size < 1:
            raise ValueError("max_batch_size, prefill_batch_size and prefill_step_size "
                             "must be >= 1")
        if fair_prefill and step_tokens <= max_batch_size:  # decode alone would fill a step
            raise ValueError(f"step_tokens must be > max_batch_size ({max_batch_size}), "
                             f"got {step_tokens}")
        self.model = model
        self.draft_model = draft_model
        self.tokenizer = tokenizer
        self.kv_store: KVSnapshotStore | None = None
        if reuse_static_kv:
            self.kv_store = kv_store if kv_store is not None else KVSnapshotStore()
        # Conversation prefixes: each prompt (minus its last token) per namespace; a later one
        # restores the longest prefix it shares (mlx_lm.server's prompt cache, namespaced).
        self.conversation_store: KVSnapshotStore | None = None
        if reuse_conversation_kv:
            self.conversation_store = (conversation_store if conversation_store is not None
                                       else KVSnapshotStore())
        # A SpecPrefill's KV (its kept tokens, at their positions) goes to the conversation store
        # too: the next turn restores it instead of scoring and sparsifying that history again.
        self.reuse_sparse_kv = reuse_sparse_kv
        self.kv_disk = kv_disk
        self.kv_store = tiered(self.kv_store, kv_disk, "static")
        self.conversation_store = tiered(self.conversation_store, kv_disk, "conversation")
        self.specprefill = specprefill or SpecPrefillConfig()
        self._draft_layers = reused_layers(self.specprefill.reuse_draft_layers, model, draft_model)
        self.stop_token_ids = tuple(stop_token_ids)
        self.vocab_size = vocab_size(model)
        # Prompt plus generated tokens may not pass the context window: beyond it RoPE models
        # degrade and a sequence's KV would grow without bound (the memory of every other one).
        # ``max_context`` lowers the model's window (never raises it) to bound KV memory.
        window = context_length(model)
        self.context_length = (max_context if window is None
                               else min(window, max_context or window))
        self.stats = EngineCounts()
        self.reuse = KVReuse(model, self.kv_store, self.conversation_store,
                             positioned=kv_cache.supports_positioned_cache(model),
                             reusable=kv_cache.supports_reuse(model), replies=reuse_reply_kv)
        self._batch = (max_batch_size, prefill_batch_size, prefill_step_size)
        # Decode ahead: drafts from each sequence's own tokens, verified in the batch's forward
        # (plain attention KV only: it is trimmed per row); None is plain decoding.
        self._speculation = (Speculation(step_tokens, self.stats)
                             if speculative and speculation_supported(model) else None)
        self._step_size = prefill_step_size
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._by_id: dict[str, EngineSequence] = {}
        self._by_uid: dict[int, EngineSequence] = {}
        # Prompts being prefilled, dense and SpecPrefill, and each step's share of them.
        self._budget = StepBudget(step_tokens) if fair_prefill else None
        self._clock = StepClock()   # a step's prefill sized by time while a stream runs
        # Without the budget: SpecPrefills in progress, oldest first, advanced one model chunk
        # per loop between BatchGenerator steps, so running sequences keep decoding.
        self._sparse_jobs: deque[SparseJob] = deque()
        self._generator: BatchGenerator  # made on the engine thread (mlx streams are per thread)
        self._start_error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=releasing_streams(self._run), name="mlx-engine",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise EngineError("the engine thread could not start") from self._start_error

    @classmethod
    def load(cls, model_dir: str | Path, draft_dir: str | Path | None = None,
             **options: Any) -> MLXEngine:
        """An engine for an mlx-lm model folder (and a draft folder with the same vocabulary)."""
        from mlx_lm import load

        options["kv_disk"] = open_kv_disk(model_dir, draft_dir, options.pop("kv_disk_dir", None),
                                          options.pop("kv_disk_bytes", 0))  # before the load
        loaded = load(str(model_dir))
        model, tokenizer = loaded[0], loaded[1]
        draft = load(str(draft_dir))[0] if draft_dir is not None else None
        options.setdefault("stop_token_ids", sorted(tokenizer.eos_token_ids))
        return cls(model, draft_model=draft, tokenizer=tokenizer, **options)

    # -- the caller's side ------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` checked for this engine (InvalidRequestError naming what is wrong), so
        ``submit`` and ``generate`` run it without checking it again."""
        return request.checked(self.vocab_size, self.context_length)

    def submit(self, request: GenerationRequest, deliver: Deliver) -> None:
        """Queue a request (checked first unless ``check`` made it for this engine's limits);
        ``deliver`` gets its events (or an exception) on the engine thread."""
        if request.limits != (self.vocab_size, self.context_length):
            request = self.check(request)
        sampler = request_sampler(request)  # a grammar's mask is per sequence: batch shared
        seq = EngineSequence(request, deliver, time.perf_counter(), sampler)
        self._post("submit", seq)

    def cancel(self, request_id: str) -> None:
        """Stop a request early; its consumer gets nothing more."""
        self._post("cancel", request_id)

    @contextmanager
    def together(self) -> Iterator[None]:
        """Whatever is submitted and cancelled inside the block, the engine thread takes in one
        step (it cannot drain its inbox until the block ends): a batch that starts together."""
        with self._wake:
            yield

    def generate(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        """Tokens of one request as they come (blocking); closing the iterator cancels it."""
        return blocking_events(self.submit, self.cancel, request)

    def agenerate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Tokens of one request as they come, for asyncio; closing the iterator cancels it."""
        return async_events(self.submit, self.cancel, request)

    def health(self) -> EngineHealth:
        """Whether the engine thread takes requests, how busy it is, if its KV disk is full."""
        return EngineHealth(ok=self._thread.is_alive() and not self._closed, active=len(
            self._by_id), queued=len(self._inbox), sparse_prefills=self._sparse_count(),
            disk_full=self.kv_disk is not None and self.kv_disk.disk_full)

    def snapshot_stats(self) -> EngineStats:
        """Engine and KV-store figures now."""
        kv_store, conv = self.kv_store, self.conversation_store
        return EngineStats(
            **counted(self.stats), active=len(self._by_id),
            kv_store=kv_store.snapshot_stats() if kv_store is not None else None,
            conversation_store=conv.snapshot_stats() if conv is not None else None,
            kv_disk=self.kv_disk.snapshot_stats() if self.kv_disk is not None else None)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called: the engine takes no more requests (read-only)."""
        return self._closed

    def close(self) -> None:
        """Finish the engine thread; requests still running get an EngineError."""
        self._post("close", None)
        self._thread.join()
        if self.kv_disk is not None:  # what it stored is on disk before it is gone
            self.kv_disk.release()

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
                while not (self._inbox or self._by_uid or self._sparse_jobs or self._budget):
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
            if self._budget is None:
                if self._sparse_jobs:
                    self._advance_sparse(self._sparse_jobs[0])
                self._decode_step()
            else:  # decode first; prompts that finished their prefill go in at once
                self._decode_step()
                if self._prefill_step():
                    self._decode_step()

    def _decode_step(self) -> None:
        if not self._by_uid:
            return
        try:
            started = time.perf_counter()
            self._step()
            self._clock.decoded(time.perf_counter() - started)
        except Exception as exc:  # a failed model step fails what was running, not the engine
            log.exception("engine step failed")
            self._fail_all(EngineError(f"model step failed: {exc}"))
            self._generator.close()
            self._generator = self._new_generator()

    def _prefill_step(self) -> bool:
        """This step's prefill work, as the budget picks it (``StepBudget.schedule``: decode
        tokens first, the rest shared across namespaces; while a stream runs, about a decode
        step's time of it, ``StepClock``), ended early as the comment below says; whether a
        prompt finished (it is in the batch: the next ``_step`` moves it to generation)."""
        assert self._budget is not None
        streaming = any(s.emitted for s in self._by_uid.values())
        limit = self._clock.prefill_tokens(self._budget.tokens, streaming)
        finished = drained = False
        # The last verify forward scored each speculating row's drafts too: decode tokens.
        drafted = self._speculation.last_step if self._speculation is not None else 0
        plan = self._budget.schedule(len(self._by_uid) + drafted, limit)
        for i, (job, tokens) in enumerate(plan):
            # After its first chunk the step ends early (what it did not run keeps its place
            # and its namespace's turn) once it has finished a namespace's last waiting prompt
            # (a quiet tenant's first token comes next, not after a flood's chunks), or when a
            # namespace with no prompt waiting sends one (it has a share from the next step on,
            # so it waits for at most one chunk).
            if i and ((drained and not finishes(job, tokens)) or self._newcomer()):
                ran = {j.namespace for j, _ in plan[:i]}
                self._budget.unrun([j for j, _ in plan[i:] if j.namespace not in ran])
                break
            if isinstance(job, SparseJob):
                done = self._advance_sparse(job)
            else:
                done = self._advance_chunked(job, tokens)
            finished |= done
            drained |= done and not self._budget.waiting(job.namespace)
        return finished

    def _newcomer(self) -> bool:
        """Whether a request waits in the inbox from a namespace with no prefill work waiting
        (another prompt of a namespace that has some would only queue behind it)."""
        assert self._budget is not None
        with self._wake:
            return any(kind == "submit" and not self._budget.waiting(item.request.namespace)
                       for kind, item in self._inbox)

    def _sparse_count(self) -> int:
        budgeted = self._budget or ()
        return len(self._sparse_jobs) + sum(isinstance(j, SparseJob) for j in budgeted)

    def _new_generator(self) -> BatchGenerator:
        generator = new_batch_generator(self.model, self.stop_token_ids, *self._batch)
        if self._speculation is not None:
            self._speculation.drafters.clear()
            self._speculation.attach(generator)
        return generator

    def _extract(self, seq: EngineSequence) -> Callable[[], Any]:
        """Reads the sequence's cache out of the batch, when the reuse policy needs it."""
        return lambda: self._generator.extract_cache([seq.uid]).get(seq.uid)

    def _step(self) -> None:
        prompt_responses, responses = self._generator.next()
        for r in prompt_responses:
            seq = self._by_uid.get(r.uid)
            if seq is None or not r.end_of_segment:
                continue
            done = seq.plan.restored + r.progress[0]
            self._restart(self.reuse.on_segment(seq, done, self._extract(seq)))
        for r in responses:
            seq = self._by_uid.get(r.uid)
            if seq is not None:
                self._emit(seq, r)

    def _emit(self, seq: EngineSequence, r: Any) -> None:
        first = seq.emitted == 0
        event = TokenEvent(
            seq.request.request_id, int(r.token), seq.emitted, r.finish_reason,
            time.perf_counter() - seq.submitted,
            r.logprobs if seq.request.return_logprobs else None,
            seq.info if first else None,
        )
        seq.emitted += 1
        seq.generated.append(int(r.token))
        self.stats.generated_tokens += 1
        if r.finish_reason is not None:
            self._forget(seq)
            self.stats.completed += 1
        self._send(seq, event)
        self.reuse.on_first_token(seq, r.prompt_cache, self._extract(seq))
        if r.finish_reason is not None:  # its prompt's and reply's KV, for the next turn
            self.reuse.on_finish(seq, r.prompt_cache)

    def _send(self, seq: EngineSequence, item: Any) -> None:
        try:
            seq.deliver(item)
        except Exception:  # a consumer that went away (closed event loop) must not stop the engine
            log.warning("could not deliver to request %s", seq.request.request_id, exc_info=True)

    def _forget(self, seq: EngineSequence) -> None:
        self._by_id.pop(seq.request.request_id, None)
        if self._budget is not None:
            job = self._budget.discard(seq.request.request_id)
            if isinstance(job, SparseJob):
                job.steps.close()
        if seq.uid is not None:
            self._by_uid.pop(seq.uid, None)
            if self._speculation is not None:
                self._speculation.forget((seq.uid,))
        self._restart(self.reuse.forget(seq))

    def _restart(self, parked: list[tuple[EngineSequence, bool]]) -> None:
        """Start again the requests that were parked on a static prefix."""
        for seq, may_park in parked:
            self._start(seq, may_park)

    def _drop(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is None:
            return
        if seq.uid is not None:
            self._generator.remove([seq.uid])
        self._forget(seq)
        self.stats.cancelled += 1

    def _fail_all(self, exc: Exception) -> None:
        self.reuse.clear()
        while self._sparse_jobs:
            self._sparse_jobs.popleft().steps.close()
        for job in self._budget or ():
            if isinstance(job, SparseJob):
                job.steps.close()
        if self._budget is not None:
            self._budget.clear()
        for seq in list(self._by_id.values()):
            seq.plan.leads = None
            self._forget(seq)
            self.stats.failed += 1
            self._send(seq, exc)

    # -- admission: how a prompt gets into the KV cache ---------------------------------------

    def _admit(self, seq: EngineSequence) -> None:
        req = seq.request
        if req.request_id in self._by_id:
            self._send(seq, EngineError(f"request id {req.request_id!r} is already running"))
            return
        self.stats.requests += 1
        self._by_id[req.request_id] = seq
        self._start(seq)

    def _start(self, seq: EngineSequence, may_park: bool = True) -> None:
        """Admit one request: decide how its prompt is prefilled.

        The rule, in order: the protected static part ends at ``specprefill_system_end`` (never
        the last prompt token); a conversation this engine served before gives back its KV
        (``conversation_hit``), else the static prefix's snapshot is what is reused. With no
        conversation hit, a request whose static prefix is being computed by another waits
        for it (parked, ``may_park``). What is left to compute is prefilled sparse
        (SpecPrefill) when the request asks for it and it is long enough, else dense, with the
        reason it could not be sparse recorded as its fallback."""
        req = seq.request
        ids = list(req.prompt_ids)
        # The last prompt token is the one generation starts from: it is never part of a snapshot.
        static = min(req.specprefill_system_end, len(ids) - 1)
        # What an earlier prompt of this conversation left dense comes back whole; SpecPrefill
        # is for what is left to compute (as oMLX admits it after its prefix cache), so a long
        # conversation of short turns stays dense instead of re-sparsifying its history.
        conv = self.reuse.conversation_hit(req, ids, static, self._keep_share(req, ids, static))
        rest = len(ids) - (conv.tokens if conv else static)
        sparse = self._wants_specprefill(req, rest)
        if may_park and conv is None and self.reuse.park(seq, ids, static):
            self.stats.parked += 1
            return
        if sparse:
            step = self._step_size if self._budget is None else min(self._step_size,
                                                                   self._budget.tokens)
            steps = specprefill_steps(
                self.reuse, self.model, self.draft_model, self.specprefill,
                namespace=req.namespace, issued=req.issued, ids=ids, static=static, conv=conv,
                keep_pct=req.specprefill_keep_pct, step=step,
                shared_layers=self._draft_layers)
            job = SparseJob(seq, ids, static, steps, step)
            if self._budget is None:
                self._sparse_jobs.append(job)
            else:
                self._budget.add(job)
            return
        fallback = "no draft model" if req.specprefill and self.draft_model is None else None
        if not sparse_capable(self.reuse, self.specprefill) and self._asks_specprefill(req, rest):
            fallback = UNSUPPORTED_LAYERS
        self._start_dense(seq, ids, static, fallback, conv)

    def _fail(self, seq: EngineSequence, exc: Exception) -> None:
        log.error("could not admit request %s", seq.request.request_id, exc_info=exc)
        self._forget(seq)
        self.stats.failed += 1
        self._send(seq, EngineError(f"could not start the request: {exc}"))

    def _keep_share(self, req: GenerationRequest, ids: list[int], static: int) -> float | None:
        """What this request keeps of its prompt after ``static`` when nothing is restored
        (None: it computes it all); what a sparse history may serve it."""
        if not self._wants_specprefill(req, len(ids) - static):
            return None
        share = self.specprefill.keep_share(req)  # negative: the draft's layers reused
        return -share if self._draft_layers else share

    def _wants_specprefill(self, req: GenerationRequest, rest: int) -> bool:
        return sparse_capable(self.reuse, self.specprefill) and self._asks_specprefill(req, rest)

    def _asks_specprefill(self, req: GenerationRequest, rest: int) -> bool:
        return self.specprefill.asked(req, rest, self.draft_model is not None)

    def _start_dense(self, seq: EngineSequence, ids: list[int], static: int, fallback: str | None,
                     conv: ConversationHit | None) -> None:
        try:
            with mx.stream(self._generator.stream):
                prefill = self.reuse.plan_dense(seq.request, ids, static, conv)
                seq.plan = prefill.plan
                if self._budget is None:
                    self._insert(seq, prefill.segments, prefill.cache)
                else:
                    job = ChunkedPrefill(seq, self.model, prefill.segments, prefill.cache,
                                         prefill.reused)
                    if job.left:
                        self._budget.add(job)
                    else:  # nothing to compute but the last token
                        self._insert(seq, [[job.last]], job.cache)
        except Exception as exc:
            self._fail(seq, exc)
            return
        seq.info = PrefillInfo(len(ids), static, prefill.reused, len(ids) - prefill.reused,
                               DENSE, fallback=fallback, conversation_tokens=prefill.conversation,
                               reply_tokens=conv.reply if conv is not None else 0)
        seq.info.tally(self.stats)

    def _insert(self, seq: EngineSequence, segments: list[list[int]], cache: list[Any]) -> None:
        seq.uid = insert_sequence(self._generator, seq, segments, cache)
        self._by_uid[seq.uid] = seq
        if self._speculation is not None:
            self._speculation.track(seq.uid, seq.request.prompt_ids)

    def _advance_chunked(self, job: ChunkedPrefill, tokens: int) -> bool:
        """``tokens`` more of a dense prompt (segment ends stored, parked requests released);
        whether it is done and in the batch."""
        seq = job.seq
        if self._by_id.get(seq.request.request_id) is not seq:  # gone earlier in this step
            self._drop_job(job)
            return False
        try:
            with mx.stream(self._generator.stream):
                while tokens > 0 and job.left > 0:
                    before, started = job.done, time.perf_counter()
                    end = job.advance(tokens)
                    self._clock.prefilled(job.done - before, time.perf_counter() - started)
                    tokens -= job.done - before
                    if end is not None:   # the static prefix or the whole prompt is in
                        self._restart(self.reuse.on_segment(seq, end, lambda: (job.cache,)))
                if job.left:
                    return False
                self._drop_job(job)
                self._insert(seq, [[job.last]], job.cache)
                return True
        except Exception as exc:
            self._drop_job(job)
            self._fail(seq, exc)
            return False

    def _drop_job(self, job: ChunkedPrefill | SparseJob) -> None:
        if self._budget is not None:
            self._budget.discard(job.seq.request.request_id)
        elif self._sparse_jobs and self._sparse_jobs[0] is job:
            self._sparse_jobs.popleft()

    def _advance_sparse(self, job: SparseJob) -> bool:
        """One model chunk of a SpecPrefill; whether it is done and its sequence in the batch.
        Any failure falls back to a dense prefill (same answer class, counted)."""
        if self._by_id.get(job.seq.request.request_id) is not job.seq:  # cancelled meanwhile
            self._drop_job(job)
            job.steps.close()
            return False
        try:
            with mx.stream(self._generator.stream):
                try:
                    next(job.steps)
                    return False
                except StopIteration as finished:
                    self._drop_job(job)
                    self._insert_sparse(job, finished.value)
                    return True
        except Exception as exc:
            self._drop_job(job)
            fallback = f"{type(exc).__name__}: {exc}"
        log.warning("SpecPrefill failed, dense prefill instead: %s", fallback)
        self.stats.fallbacks += 1
        self.stats.last_fallback = fallback
        req = job.seq.request
        conv = self.reuse.conversation_hit(req, job.ids, job.static,
                                           self._keep_share(req, job.ids, job.static))
        self._start_dense(job.seq, job.ids, job.static, fallback, conv)
        return False

    def _insert_sparse(self, job: SparseJob, done: SparsePrefill) -> None:
        seq, ids, n = job.seq, job.ids, len(job.ids)
        self._insert(seq, [[ids[-1]]], done.cache)  # prefilled: no slot to wait for
        if self.reuse_sparse_kv and self.reuse.positioned and self.conversation_store \
                is not None and n > 1:   # a layered model's sparse state is no prompt's own
            # The prompt minus its last token is all in the cache: stored after the first
            # token, as a dense prompt is (planned once inserted: a failure before falls back to
            # a dense admission, which must not inherit any of it).
            protected = (done.protected_positions if done.protected_positions is not None
                         else tuple(range(done.protected)))
            seq.plan = ReusePlan(restored=n - 1, restored_positions=protected + done.kept,
                                 keep_pct=self._keep_share(seq.request, ids, job.static),
                                 conversation_at=n - 1, conversation_ready=True)
        conversation = done.reused if done.from_conversation else 0
        computed = (done.protected - done.reused) + len(done.kept) + 1
        seq.info = PrefillInfo(n, job.static, done.reused, computed, SPECPREFILL,
                               kept_tokens=len(done.kept) + 1,
                               conversation_tokens=conversation, reply_tokens=done.reply)
        seq.info.tally(self.stats)

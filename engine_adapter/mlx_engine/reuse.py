"""KV reuse across requests: the static-prefix store, the conversation store, and requests
parked on a static prefix another request is computing.

One object with three calls, as vLLM's KV cache manager: ``plan_dense`` (what a request
restores, what it must compute and what it stores: its ``ReusePlan``), ``on_segment`` (a prompt
segment was prefilled: snapshot the static prefix, release the requests parked on it) and
``on_first_token`` (the prompt's KV goes to the conversation store once the first token is
out, so copying it never delays that token).

    static store        namespace + exact prefix ids -> KV of [0, boundary); target and draft
    conversation store  namespace -> each prompt minus its last token; a new prompt restores
                        the longest prefix it shares with one (an earlier turn it extends, or a
                        sibling), when that is longer than its static prefix
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

from . import kv_cache
from .kv_cache import KVSnapshot
from .kv_store import Key, KVSnapshotStore, prefix_key
from .prefill import dense_prefill_steps
from .request import DENSE, GenerationRequest

log = logging.getLogger("engine_adapter.mlx_engine")

TARGET_ID, DRAFT_ID = "target", "draft"
Extract = Callable[[], Any]   # the sequence's per-sequence cache as BatchGenerator holds it now


@dataclass(frozen=True, slots=True)
class ConversationHit:
    """An earlier prompt of the namespace sharing ``tokens`` leading tokens with this one."""

    tokens: int
    snapshot: KVSnapshot


@dataclass(slots=True)
class ReusePlan:
    """One request's KV reuse: decided at admission, carried out as its prefill runs."""

    restored: int = 0           # prompt tokens restored before insertion (the batch counts after)
    # Prompt positions of the tokens stored for [0, restored) when some were dropped (a
    # SpecPrefill's KV, or a restore of one); None: dense, all of them.
    restored_positions: tuple[int, ...] | None = None
    keep_pct: float | None = None   # the keep share that chose them (sparse only)
    static_at: int = 0          # >0: snapshot [0, static_at) into the static store then
    conversation_at: int = 0    # >0: store [0, conversation_at) in the conversation store ...
    conversation_ready: bool = False  # ... that segment is prefilled: after the first token
    leads: Key | None = None    # the static prefix requests parked on this one wait for


class EngineSequence(Protocol):
    """What reuse reads of a request inside the engine (``sequence.EngineSequence``, which
    holds a ``ReusePlan``: a protocol here, so the two modules do not import each other)."""

    request: GenerationRequest
    plan: ReusePlan


@dataclass(frozen=True, slots=True)
class DensePrefill:
    """What a dense admission inserts into the batch, and what it reused."""

    segments: list[list[int]]
    cache: list[Any]
    plan: ReusePlan
    reused: int
    conversation: int           # of ``reused``: from the conversation store


class KVReuse:
    """The engine's KV stores and the requests parked on a static prefix being computed."""

    def __init__(self, model: Any, kv_store: KVSnapshotStore | None,
                 conversation_store: KVSnapshotStore | None, *, positioned: bool,
                 reusable: bool | None = None, keep_replies: bool = False) -> None:
        self.model = model
        self.kv_store = kv_store
        self.conversation_store = conversation_store
        # Plain full-attention models: KV stored sparse, trimmed to any prefix, and copied once
        # the first token is out.
        self.positioned = positioned
        # Those and models with sliding-window or recurrent layers: their snapshots
        # (``layered``) are taken exactly at segment ends and restored only whole.
        self.reusable = positioned if reusable is None else reusable
        # Single flight per static prefix: while one request prefills it, later ones with the
        # same (namespace, prefix ids) wait here and then restore it instead of recomputing.
        self._computing: dict[Key, list[EngineSequence]] = {}
        self._parked_on: dict[str, Key] = {}   # request id -> the prefix it waits for
        # A finished dense sequence's reply KV goes to the conversation store with its prompt's
        # (``on_token``): the tokens each one generated so far, and the last one to leave (the
        # engine forgets a sequence just before its final token comes here).
        self.keep_replies = keep_replies
        self._replies: dict[str, list[int]] = {}
        self._left: tuple[str, list[int]] | None = None

    # -- admission ---------------------------------------------------------------------------

    def conversation_hit(self, req: GenerationRequest, ids: list[int], static: int,
                         keep_pct: float | None) -> ConversationHit | None:
        """The stored prompt of this namespace that shares the longest prefix with ``ids``
        (an earlier turn it extends, or a sibling), when that shared part is longer than the
        static prefix; else None (the static path). ``keep_pct``: the share this request keeps
        when it SpecPrefills from its static prefix, None when it would compute it all."""
        if self.conversation_store is None or not self.reusable:
            return None
        hit = self.conversation_store.longest_common_prefix(req.namespace, TARGET_ID, ids,
                                                            len(ids) - 1, min_tokens=static)
        if hit is None:
            return None
        n, snap = hit
        if not getattr(snap, "trimmable", True) and n != snap.prompt_tokens:
            return None  # a recurrent state or a window stands for all its tokens, no fewer
        dense = snap.dense_tokens
        if n > dense and not (dense >= static and keep_pct is not None
                              and snap.keep_pct == keep_pct):
            # A sparse entry serves only what this request would keep itself: all before its
            # boundary (an entry SpecPrefilled with an earlier boundary sparsified part of this
            # static prefix), and after it what the same keep share chose (a request that
            # computes its whole prompt, or keeps another share, gets none of that). Otherwise
            # only the part stored whole is restored, and the rest computed.
            n = dense
            if n <= static:
                return None
        if snap.stored_before(n) == 0:
            return None  # a sparse entry that kept nothing of the shared part: nothing to restore
        return ConversationHit(n, snap)

    def park(self, seq: EngineSequence, ids: list[int], static: int) -> bool:
        """Park ``seq`` when another request is computing its static prefix right now."""
        if not (static and self.kv_store is not None and self.reusable):
            return False
        key = prefix_key(seq.request.namespace, TARGET_ID, ids[:static])[0]
        waiting = self._computing.get(key)
        if waiting is None:
            return False
        waiting.append(seq)
        self._parked_on[seq.request.request_id] = key
        return True

    def plan_dense(self, req: GenerationRequest, ids: list[int], static: int,
                   conv: ConversationHit | None) -> DensePrefill:
        """Restore the conversation prefix, or the static prefix, or nothing; the rest is
        computed, and the prompt minus its last token is stored once prefilled."""
        plan = ReusePlan()
        last = len(ids) - 1 if self.conversation_store is not None and self.reusable else 0
        if conv is not None:
            reused = plan.restored = conv.tokens
            plan.restored_positions = conv.snapshot.positions_before(reused)
            plan.keep_pct = conv.snapshot.keep_pct
            plan.conversation_at = last if last > reused else 0
            cache = kv_cache.restore(conv.snapshot, reused, copy=False)
            return DensePrefill([ids[reused:]], cache, plan, reused, reused)
        if self.kv_store is not None and self.reusable and static > 0:
            snap = self.kv_store.get(req.namespace, TARGET_ID, ids[:static])
            if snap is not None:
                plan.restored = static
                plan.conversation_at = last if last > static else 0
                return DensePrefill([ids[static:]], kv_cache.restore(snap, copy=False), plan, static, 0)
            cache = kv_cache.make_cache(self.model)
            plan.static_at, plan.conversation_at = static, last
            # From here on requests with this static prefix park until this one stores it
            # (or leaves: ``forget`` releases them).
            plan.leads = prefix_key(req.namespace, TARGET_ID, ids[:static])[0]
            self._computing.setdefault(plan.leads, [])
            return DensePrefill([ids[:static], ids[static:]], cache, plan, 0, 0)
        plan.conversation_at = last
        return DensePrefill([ids], kv_cache.make_cache(self.model), plan, 0, 0)

    def static_cache_steps(self, model: Any, model_id: str, namespace: str, ids: list[int],
                           static: int, step: int) -> Generator[None, None, tuple[list[Any], int]]:
        """A per-sequence cache holding [0, static) and the tokens reused: restored, or
        computed chunk by chunk (and stored)."""
        if static and self.kv_store is not None:
            snap = self.kv_store.get(namespace, model_id, ids[:static])
            if snap is not None:
                return kv_cache.restore(snap), static
        cache = kv_cache.make_cache(model)
        if static:
            yield from dense_prefill_steps(model, ids[:static], cache, step)
            if self.kv_store is not None:
                self.kv_store.put(namespace, model_id, ids[:static], kv_cache.snapshot(cache, static))
        return cache, 0

    # -- as the prefill runs -----------------------------------------------------------------

    def on_segment(self, seq: EngineSequence, done: int, extract: Extract) -> list[tuple[EngineSequence, bool]]:
        """Prompt tokens up to ``done`` are prefilled; the parked requests to start again,
        each with whether it may park again."""
        plan = seq.plan
        if done <= 0:
            return []
        if done == plan.static_at:
            return self._store_segment(seq, done, extract)
        if done == plan.conversation_at:
            if not self.positioned:
                # A recurrent state or a window cannot be cut back to this point once the
                # last prompt token is in: the snapshot is taken here, before the first token.
                self._store_segment(seq, done, extract)
                return []
            # Copying the prompt's KV now would delay the first token; the sequence keeps that
            # KV, so it is stored right after the first token is delivered.
            plan.conversation_ready = True
        return []

    def _store_segment(self, seq: EngineSequence, n: int, extract: Extract) -> list[tuple[EngineSequence, bool]]:
        plan = seq.plan
        static, conversation = n == plan.static_at, n == plan.conversation_at
        if static:
            plan.static_at = 0
        if conversation:
            plan.conversation_at = 0
        extracted = extract()
        stored = False
        ids = seq.request.prompt_ids
        if extracted is None or kv_cache.cache_size(extracted[0]) != n:
            log.warning("segment of %s not where expected; not stored", seq.request.request_id)
        else:
            snap = kv_cache.snapshot(extracted[0], n)
            if static and self.kv_store is not None:
                stored = self.kv_store.put(seq.request.namespace, TARGET_ID, ids[:n], snap)
            if conversation and self.conversation_store is not None:
                # One snapshot object for both is fine: snapshots are never written to.
                self.conversation_store.put(seq.request.namespace, TARGET_ID, ids[:n], snap,
                                            supersede=True)
        return self.release(seq, stored, leader_running=True) if static else []

    def on_token(self, seq: EngineSequence, token: int, finish_reason: str | None,
                 prompt_cache: Any, extract: Extract) -> None:
        """After each token out: the prompt's KV once the first is (``on_first_token``); at a
        normal finish, the KV of the prompt and of the reply (``_store_reply``)."""
        self.on_first_token(seq, prompt_cache, extract)
        info, rid = seq.info, seq.request.request_id
        if (not self.keep_replies or self.conversation_store is None or not self.positioned
                or info is None or info.mode != DENSE or seq.plan.restored_positions is not None):
            return   # a sparse KV holds fewer tokens than it stands for: its prompt only
        reply = self._replies.pop(rid, None)
        if reply is None and self._left is not None and self._left[0] == rid:
            reply = self._left[1]
        if reply is None and seq.emitted != 1:
            return   # not followed from its first token
        reply = reply if reply is not None else []
        reply.append(token)
        if finish_reason is None:
            self._replies[rid] = reply
        elif finish_reason in ("stop", "length"):   # not cancelled or failed: all computed
            self._store_reply(seq, reply, prompt_cache)

    def _store_reply(self, seq: EngineSequence, reply: list[int], cache: Any) -> None:
        """The prompt and the reply, but its last token (never fed), as one conversation entry:
        a next prompt that sends the reply back restores up to where its ids part from these."""
        ids = list(seq.request.prompt_ids) + reply[:-1]
        if len(reply) < 2 or self.conversation_store is None:
            return
        try:
            if cache is None or kv_cache.cache_size(cache) < len(ids):
                log.warning("reply KV of %s not there; not stored", seq.request.request_id)
                return
            self.conversation_store.put(seq.request.namespace, TARGET_ID, ids,
                                        kv_cache.snapshot(cache, len(ids)), supersede=True)
        except Exception:
            log.warning("could not store the reply KV of %s", seq.request.request_id,
                        exc_info=True)

    def on_first_token(self, seq: EngineSequence, prompt_cache: Any, extract: Extract) -> None:
        """Store the prompt minus its last token in the conversation store, copied from the KV
        the sequence holds once its first token is out (the finished response's cache, or the
        running batch's); a failure here costs a later reuse, never this request."""
        plan = seq.plan
        if not plan.conversation_ready:
            return
        n, plan.conversation_at, plan.conversation_ready = plan.conversation_at, 0, False
        store = self.conversation_store
        if store is None or n <= 0:
            return
        try:
            positions = plan.restored_positions
            if positions is not None:     # sparse: what was restored or kept, then all the rest
                positions = positions + tuple(range(plan.restored, n))
            stored = n if positions is None else len(positions)
            cache = prompt_cache
            if cache is None:
                extracted = extract()
                cache = extracted[0] if extracted is not None else None
            if cache is None or kv_cache.cache_size(cache) < stored:
                log.warning("prompt KV of %s not there; not stored", seq.request.request_id)
                return
            snap = (kv_cache.snapshot(cache, n) if positions is None
                    else kv_cache.snapshot(cache, stored, positions=positions, span=n,
                                     keep_pct=plan.keep_pct))
            store.put(seq.request.namespace, TARGET_ID, seq.request.prompt_ids[:n], snap,
                      supersede=True)
        except Exception:
            log.warning("could not store the prompt KV of %s", seq.request.request_id,
                        exc_info=True)

    # -- leaving ------------------------------------------------------------------------------

    def release(self, leader: EngineSequence, stored: bool,
                leader_running: bool) -> list[tuple[EngineSequence, bool]]:
        """The requests parked on ``leader``'s static prefix, to start again: they restore it
        if it was stored; if it could not be (too big for the store) they compute it side by
        side; if the leader left before storing it, the first of them leads now."""
        key, leader.plan.leads = leader.plan.leads, None
        followers = self._computing.pop(key, []) if key is not None else []
        for seq in followers:
            self._parked_on.pop(seq.request.request_id, None)
        may_park = stored or not leader_running
        return [(seq, may_park) for seq in followers]

    def forget(self, seq: EngineSequence) -> list[tuple[EngineSequence, bool]]:
        """``seq`` leaves (done, cancelled, failed); the parked requests to start again."""
        rid = seq.request.request_id
        self._left = (rid, self._replies.pop(rid)) if rid in self._replies else None
        key = self._parked_on.pop(seq.request.request_id, None)
        if key is not None:
            waiting = self._computing.get(key, [])
            if seq in waiting:
                waiting.remove(seq)
        if seq.plan.leads is not None:  # gone before its static prefix was stored
            return self.release(seq, stored=False, leader_running=False)
        return []

    def clear(self) -> None:
        """Forget every parked request (the engine fails them all)."""
        self._computing.clear()
        self._parked_on.clear()
        self._replies.clear()
        self._left = None

"""StaticPrefixCache: specprefill_system_end with the probe renders run only on a miss.

    request -> key (xxh3-128 of namespace, render identity, static messages, tools, kwargs[, date])
            -> store.get(key) -- hit  -> boundary = common_prefix_len(prompt_ids, stored ids)
                              -- miss -> two-probe render once per key (single-flight), store.put

A hit returns exactly what the uncached computation returns, because the stored value is the
very scaffold the uncached path would compute and the boundary is cut against this request's
own prompt ids. Store failures and bad entries cost a recompute, never an error or a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from . import boundary, keys
from .entry import Entry, decode_entry, encode_entry
from .errors import EntryError, PrefixCacheError, StoreUnavailableError
from .messages import count_static, validate_kwargs, validate_messages, validate_tools
from .observer import CacheObserver, ObserverGroup
from .render import TemplateRenderer, get_renderer
from .singleflight import SingleFlight
from .stats import CacheStats
from .store import MemoryStore, Store
from .token_ids import TokenIds, checked_token_ids

log = logging.getLogger("prefix_cache")

HIT, MISS, NONE = "hit", "miss", "none"


@dataclass(frozen=True, slots=True)
class PrefixResult:
    """The answer for one request."""

    specprefill_system_end: int
    prompt_ids: list[int]
    cache: str          # "hit", "miss", or "none" when there is no static part
    key: str            # "" when cache == "none"
    static_tokens: int = 0  # length of the template's static scaffold (>= the boundary)

    @property
    def hit(self) -> bool:
        return self.cache == HIT


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything resolved before any render: validated inputs, renderer and key."""

    renderer: TemplateRenderer
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    static: list[dict[str, Any]] | None  # None: nothing to protect, boundary 0
    key: str
    check: int
    namespace: str
    model: str
    started: float


class StaticPrefixCache:
    """Resolves ``specprefill_system_end`` for chat requests, caching the static scaffold."""

    def __init__(
        self,
        store: Store | None = None,
        *,
        prefix: str = keys.DEFAULT_PREFIX,
        ttl_seconds: float | None = None,
        protect_default_prefix: bool = False,
        max_render_threads: int | None = None,
        observer: CacheObserver | None = None,
    ) -> None:
        self.store: Store = store if store is not None else MemoryStore()
        self.prefix = keys.validate_label(prefix, "key prefix")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive or None, got {ttl_seconds}")
        self.ttl_seconds = ttl_seconds
        # Off by default, matching the reference engines: with no system message there is no
        # request-owned static part. On, the template's own default system block and tools
        # are protected too.
        self.protect_default_prefix = protect_default_prefix
        # One stream of events, two tallies of it: ``stats`` in this process, and whatever the
        # caller observes (the service's Prometheus metrics, aggregated across workers).
        self.stats = CacheStats()
        self.observer = observer or CacheObserver()
        self._events = ObserverGroup(self.stats, self.observer)
        self._flights = SingleFlight()
        self._executor = ThreadPoolExecutor(
            max_workers=max_render_threads or min(8, (os.cpu_count() or 2) + 2),
            thread_name_prefix="prefix-render",
        )

    # -- public API ---------------------------------------------------------------------------

    def resolve(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        chat_template: str | None = None,
        namespace: str = "default",
        model: str | None = None,
    ) -> PrefixResult:
        """The boundary for one request (blocking; renders run in the calling thread)."""
        try:
            plan = self._plan(tokenizer, messages, tools, chat_template_kwargs,
                              chat_template, namespace, model)
            prompt = self._prompt(plan, prompt_ids)
            if plan.static is None:
                return self._none(plan, prompt.ids)
            entry = self._read(plan, self._get(plan.key))
            if entry is not None:
                return self._hit(plan, prompt, entry)
            static_ids = self._await_flight_sync(plan)
        except PrefixCacheError as exc:
            self._failed(namespace, model, tokenizer, exc)
            raise
        return self._miss(plan, prompt.ids, static_ids)

    async def aresolve(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        chat_template: str | None = None,
        namespace: str = "default",
        model: str | None = None,
    ) -> PrefixResult:
        """The boundary for one request; renders run in a thread pool, off the event loop."""
        loop = asyncio.get_running_loop()
        try:
            plan = self._plan(tokenizer, messages, tools, chat_template_kwargs,
                              chat_template, namespace, model)
            if prompt_ids is None:
                prompt = await loop.run_in_executor(self._executor, self._prompt, plan, None)
            else:
                prompt = self._prompt(plan, prompt_ids)
            if plan.static is None:
                return self._none(plan, prompt.ids)
            entry = self._read(plan, await self._aget(plan.key))
            if entry is not None:
                return self._hit(plan, prompt, entry)
            flight, leader = self._flights.claim(plan.key)
            if leader:
                loop.run_in_executor(self._executor, self._lead, plan, flight)
            else:
                self._events.waited()
            # Shielded: a cancelled request must not cancel the flight others wait on.
            static_ids = await asyncio.shield(asyncio.wrap_future(flight))
        except PrefixCacheError as exc:
            self._failed(namespace, model, tokenizer, exc)
            raise
        return self._miss(plan, prompt.ids, static_ids)

    def _failed(self, namespace: str, model: str | None, tokenizer: Any, exc: Exception) -> None:
        label = keys.model_label(model or getattr(tokenizer, "name_or_path", "") or "model")
        self._events.failed(namespace=namespace, model=label, error=exc)

    def close(self) -> None:
        """Stop the render threads and close the store."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    # -- steps --------------------------------------------------------------------------------

    def _plan(self, tokenizer: Any, messages: Any, tools: Any, kwargs: Any,
              chat_template: str | None, namespace: str, model: str | None) -> _Plan:
        started = time.perf_counter()
        keys.validate_label(namespace, "namespace")
        messages = validate_messages(messages)
        tools = validate_tools(tools)
        kwargs = validate_kwargs(kwargs)
        renderer = get_renderer(tokenizer, chat_template, tools)
        n_static = count_static(messages)
        everything_static = n_static == len(messages)
        label = keys.model_label(model or getattr(renderer.tokenizer, "name_or_path", "") or "model")
        if everything_static or (n_static == 0 and not self.protect_default_prefix):
            return _Plan(renderer, messages, tools, kwargs, None, "", 0, namespace, label, started)
        static = messages[:n_static]
        material = keys.key_material(
            namespace=namespace, identity=renderer.identity, static=static,
            tools=tools, kwargs=kwargs, date=renderer.date_tag(),
        )
        key = keys.format_key(self.prefix, namespace, label, keys.key_hash(material))
        return _Plan(renderer, messages, tools, kwargs, static, key, keys.check_value(material),
                     namespace, label, started)

    def _prompt(self, plan: _Plan, prompt_ids: Sequence[int] | None) -> TokenIds:
        """The prompt's ids, checked when the caller gave them, packed for the hit's cut."""
        if prompt_ids is not None:
            return checked_token_ids(prompt_ids)
        self._events.prompt_rendered()
        ids = plan.renderer.render_ids(plan.messages, plan.tools, plan.kwargs)
        return TokenIds.of_rendered(ids)

    def _none(self, plan: _Plan, prompt: list[int]) -> PrefixResult:
        return self._report(plan, PrefixResult(0, prompt, NONE, ""))

    def _miss(self, plan: _Plan, prompt: list[int], static_ids: list[int]) -> PrefixResult:
        end = boundary.system_end(prompt, static_ids)
        return self._report(plan, PrefixResult(end, prompt, MISS, plan.key, len(static_ids)))

    def _report(self, plan: _Plan, result: PrefixResult) -> PrefixResult:
        self._events.resolved(cache=result.cache, namespace=plan.namespace, model=plan.model,
                               seconds=time.perf_counter() - plan.started,
                               static_tokens=result.static_tokens,
                               boundary=result.specprefill_system_end)
        return result

    def _hit(self, plan: _Plan, prompt: TokenIds, entry: Entry) -> PrefixResult:
        # Same cut as _miss, done on packed bytes: the stored ids are never unpacked.
        n = entry.n_static
        end = boundary.packed_prefix_len(prompt.packed[:4 * n], entry.packed_ids)
        self._events.saved(model=plan.model, seconds=entry.render_seconds)
        return self._report(plan, PrefixResult(end, prompt.ids, HIT, plan.key, n))

    def _read(self, plan: _Plan, value: bytes | None) -> Entry | None:
        """Decode a stored value; anything that is not exactly ours counts as a miss."""
        if value is None:
            return None
        try:
            return decode_entry(value, plan.key, plan.check)
        except EntryError as exc:
            log.warning("rejected stored entry %s: %s", plan.key, exc)
            self._events.verification_failure()
            return None

    def _await_flight_sync(self, plan: _Plan) -> list[int]:
        flight, leader = self._flights.claim(plan.key)
        if leader:
            self._lead(plan, flight)
        else:
            self._events.waited()
        return flight.result()

    def _lead(self, plan: _Plan, flight: Future[list[int]]) -> None:
        """Compute the scaffold once, store it, publish it to waiters, then end the flight."""
        try:
            try:
                ids = self._recheck(plan)
                if ids is not None:
                    flight.set_result(ids)
                    return
                ids, seconds = self._compute(plan)
            except BaseException as exc:  # waiters get the same error the leader got
                flight.set_exception(exc)
                return
            # Store first, then publish: a caller that sees this result and asks again at once
            # must find the entry (a bounded wait: store calls are under a short timeout).
            try:
                self._put(plan, ids, seconds)
            except Exception:  # an unstorable entry still answers this request
                log.exception("could not store entry %s", plan.key)
            flight.set_result(ids)
        finally:
            if not flight.done():  # never leave waiters hanging
                flight.set_exception(RuntimeError("static-prefix computation was abandoned"))
            self._flights.release(plan.key, flight)

    def _recheck(self, plan: _Plan) -> list[int] | None:
        """Another flight may have stored the entry between our read and our claim: one more
        read is far cheaper than the two renders it can save."""
        stored = self._get(plan.key)
        if stored is None:
            return None
        try:
            return decode_entry(stored, plan.key, plan.check).static_ids
        except EntryError:
            return None

    def _compute(self, plan: _Plan) -> tuple[list[int], float]:
        started = time.perf_counter()
        ids = boundary.static_prefix_ids(
            lambda conv: plan.renderer.render_ids(conv, plan.tools, plan.kwargs), plan.static or []
        )
        elapsed = time.perf_counter() - started
        self._events.computed(model=plan.model, seconds=elapsed, static_tokens=len(ids))
        return ids, elapsed

    # -- store access, failures converted to misses in one place -------------------------------

    def _get(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except StoreUnavailableError as exc:
            self._store_failed("get", exc)
            return None

    async def _aget(self, key: str) -> bytes | None:
        try:
            return await self.store.aget(key)
        except StoreUnavailableError as exc:
            self._store_failed("get", exc)
            return None

    def _put(self, plan: _Plan, ids: list[int], render_seconds: float) -> None:
        value = encode_entry(plan.key, plan.check, ids, render_seconds)
        try:
            self.store.put(plan.key, value, self.ttl_seconds)
        except StoreUnavailableError as exc:
            self._store_failed("put", exc)

    def _store_failed(self, op: str, exc: StoreUnavailableError) -> None:
        self._events.store_error(op=op)
        log.warning("store %s failed, computing instead: %s", op, exc)


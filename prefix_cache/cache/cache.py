"""StaticPrefixCache: specprefill_system_end with the probe renders run only on a miss.

    request -> key (xxh3-128 of namespace, render identity, static messages, tools, kwargs[, date])
            -> store.get(key) -- hit  -> the stored scaffold (and the static text's safe split)
                              -- miss -> probe renders once per key (single-flight), store.put
            -> prompt ids: given, or the render's text tokenized from the split on
               (prompt_tokens.py: the stored ids up to the split, then the rest of the text)
            -> boundary = common_prefix_len(prompt_ids, scaffold), never past the first
               non-static message's text (boundary.py)

A hit returns exactly what the uncached computation returns, because the stored value is the
very scaffold (and cap, tools choice and split) the uncached path would compute from the key's
inputs, the prompt's ids are those of a full tokenization of its render, and the boundary is cut
against them in one function for both. Prompt ids are checked before anything is looked up or
stored. Store failures and bad entries cost a recompute, never an error or a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Unpack

from . import boundary, keys
from .entry import DecodedEntries, Entry, decode_entry, encode_entry
from ..errors import EntryError, PrefixCacheError, StoreUnavailableError, TemplateRenderError
from ..fastpath import FastKeyPacker, FastPromptText, FastPromptTokenizer, fast_path_setting
from .messages import dynamic_chars
from .observer import CacheObserver, ObserverGroup
from ._plan import Plan as _Plan
from ._plan import make_plan
from ._probes import probe
from .prompt_text import PromptText
from .prompt_tokens import DEFAULT_CHECK_RATE, PromptTokenizer, validate_check_rate
from ..render.render import Renderers, default_renderers, with_choice
from ._request import (
    Driven,
    Flight,
    Lookup,
    PrefixRequest,
    RequestOptions,
    Step,
    Work,
    prefix_request,
)
from ._result import HIT, MISS, NONE, PrefixResult, RenderedText
from ._singleflight import SingleFlight
from ._stats import CacheStats
from ..store import MemoryStore, Store
from ..util.token_ids import TokenIds, checked_token_ids, pack_ids

__all__ = ["HIT", "MISS", "NONE", "PrefixResult", "StaticPrefixCache"]

log = logging.getLogger("prefix_cache")

# A hit whose non-static messages are at most this long is rendered and tokenized on the event
# loop (~0.1-0.3 ms; a hop to a render thread and back costs as much, more on a busy machine).
INLINE_HIT_CHARS = 8192


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
        tokenize_check_rate: float = DEFAULT_CHECK_RATE,
        fast_path: bool | None = None,
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
        # The collaborators, plain or accelerated (``fastpath``: the same answers, cheaper):
        # accelerated unless turned off here or by PREFIX_CACHE_FAST_PATH=off. The key packer
        # (fields packed in C), the renderer (direct renders), the prompt tokenizer (from the
        # entry's split, checked at ``tokenize_check_rate``) and stored entries' decoding
        # (decoded entries remembered per key).
        self.fast_path = fast_path_setting(fast_path)
        check_rate = validate_check_rate(tokenize_check_rate)
        self._packer: keys.KeyPacker = keys.KeyPacker()
        self._text = PromptText()
        self._tokens = PromptTokenizer(self._events)
        self._decode_entry = decode_entry
        if self.fast_path:
            self._packer = FastKeyPacker(self._packer)
            self._text = FastPromptText(self._text)
            self._tokens = FastPromptTokenizer(self._tokens, self._text, check_rate)
            self._decode_entry = DecodedEntries().decode
        self._flights = SingleFlight()
        # This cache's renderers; the tokenizer states through the process's one memo: a full
        # fingerprint reads the whole vocabulary (0.2-0.4 s at 150k tokens), and a new cache on
        # a tokenizer already read must not pay it again (each call still reads the settings
        # whole, so a changed tokenizer is a new state either way).
        self._renderers = Renderers(default_renderers().states)
        self._executor = ThreadPoolExecutor(
            max_workers=max_render_threads or min(8, (os.cpu_count() or 2) + 2),
            thread_name_prefix="prefix-render",
        )
        self._handed = 0  # calls handed to the render threads (``render_thread_calls``)

    # -- public API ---------------------------------------------------------------------------

    def resolve(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None = None,
                chat_template_kwargs: Mapping[str, Any] | None = None,
                **options: Unpack[RequestOptions]) -> PrefixResult:
        """The boundary for one request (blocking; renders run in the calling thread).

        Keyword-only (``RequestOptions``): ``prompt_ids``, ``chat_template``, ``namespace``,
        ``model``; ``add_generation_prompt`` and ``continue_final_message``, which are
        ``apply_chat_template``'s (they change how the prompt is rendered; the probes render
        as the contract says, and the boundary is cut against that prompt); ``hints``: what
        the request's body parse already packed (``prefix_cache.util.hints.Hints``)."""
        run = Driven(self._steps(prefix_request(tokenizer, messages, tools,
                                                chat_template_kwargs, **options)))
        while (step := run.next_step()) is not None:
            try:
                run.outcome = (True, self._do(step))
            except Exception as exc:  # raised inside the sequence, where it asked
                run.outcome = (False, exc)
        return run.result  # type: ignore[no-any-return]

    async def aresolve(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[Mapping[str, Any]] | None = None,
                       chat_template_kwargs: Mapping[str, Any] | None = None,
                       **options: Unpack[RequestOptions]) -> PrefixResult:
        """``resolve``, with renders in a thread pool, off the event loop."""
        run = Driven(self._steps(prefix_request(tokenizer, messages, tools,
                                                chat_template_kwargs, **options)))
        loop = asyncio.get_running_loop()
        while (step := run.next_step()) is not None:
            try:
                run.outcome = (True, await self._ado(step, loop))
            except Exception as exc:  # raised inside the sequence, where it asked
                run.outcome = (False, exc)
        return run.result  # type: ignore[no-any-return]

    @property
    def render_thread_calls(self) -> int:
        """How many calls ``aresolve`` has handed to the render threads (read-only: where a
        request's renders and tokenizations ran; a short hit runs on the event loop)."""
        return self._handed

    def _in_thread(self, loop: asyncio.AbstractEventLoop, function: Any,
                   *args: Any) -> asyncio.Future[Any]:
        self._handed += 1
        return loop.run_in_executor(self._executor, function, *args)

    def _do(self, step: Step) -> Any:
        """One step, in this thread."""
        if isinstance(step, Lookup):
            return self._get(step.key)
        if isinstance(step, Work):
            return step.function(*step.args)
        return self._await_flight_sync(step.plan)

    async def _ado(self, step: Step, loop: asyncio.AbstractEventLoop) -> Any:
        """One step, renders in the thread pool."""
        if isinstance(step, Lookup):
            return await self._aget(step.key)
        if isinstance(step, Work):
            return await self._in_thread(loop, step.function, *step.args)
        return await self._await_flight(step.plan, loop)

    def _steps(self, request: PrefixRequest) -> Generator[Step, Any, PrefixResult]:
        """The decision sequence of one request, written once: it yields the I/O it needs
        (``Lookup``, ``Work``, ``Flight``) and a driver (``resolve``, ``aresolve``) sends back
        the result; it returns the answer."""
        try:
            plan = self._plan(request)
            given = checked_token_ids(request.prompt_ids) \
                if request.prompt_ids is not None else None
            if plan.static is None:
                if given is None:
                    given = (yield Work(self._prepare, (plan, None, None)))[0]
                return self._none(plan, given)
            stored = self._read(plan, (yield Lookup(plan.key))) if plan.cached else None
            cache = MISS if stored is None else HIT
            if given is not None:
                entry = stored if stored is not None else (yield Flight(plan))
                prompt = given
                end, past_cap = self._cut(plan, given, entry)
                if past_cap:
                    end = yield Work(self._capped, (plan, given, entry, end))
            elif stored is not None:
                entry = stored
                check = self._tokens.sampled()
                if check or not self._tokens.inline_hits or \
                        dynamic_chars(plan.messages, plan.n_static) > INLINE_HIT_CHARS:
                    prompt, end = yield Work(self._prepare, (plan, None, entry, check))
                else:  # a short dynamic part: rendered and tokenized faster than a thread hop
                    prompt = self._prompt(plan, None, entry, check)
                    end, past_cap = self._cut(plan, prompt, entry)
                    if past_cap:  # one more render of the whole prompt: off the loop
                        end = yield Work(self._capped, (plan, prompt, entry, end))
            else:  # the prompt first: a request whose own render fails stores nothing
                text = yield Work(self._render, (plan,))
                entry = yield Flight(plan)
                prompt, end = yield Work(self._prepare, (plan, text, entry))
        except PrefixCacheError as exc:
            label = keys.model_label(request.model or
                                     getattr(request.tokenizer, "name_or_path", "") or "model")
            self._events.failed(namespace=request.namespace, model=label, error=exc)
            raise
        return self._answer(plan, prompt, end, entry, cache)

    def close(self) -> None:
        """Stop the render threads and close the store."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    # -- steps --------------------------------------------------------------------------------

    def _plan(self, r: PrefixRequest) -> _Plan:
        tools, packer = self._packer.request(r.tools, r.hints)
        return make_plan(r.tokenizer, r.messages, tools, r.chat_template_kwargs,
                         r.chat_template, r.namespace, r.model, r.options, prefix=self.prefix,
                         protect_default_prefix=self.protect_default_prefix,
                         renderers=self._renderers, packer=packer)

    def _render(self, plan: _Plan) -> RenderedText:
        """The request's prompt text, with the documented tools fallback."""
        self._events.prompt_rendered()
        text, tools = with_choice(plan.tools, lambda choice: self._text.render(
            plan, plan.messages, choice, plan.options))
        return RenderedText(text, plan.tools is None and tools is not None)

    def _prepare(self, plan: _Plan, text: RenderedText | None, entry: Entry | None,
                 check: bool | None = None) -> tuple[TokenIds, int]:
        """The rendered prompt's ids and its boundary (``_prompt``)."""
        prompt = self._prompt(plan, text, entry, check)
        return prompt, (0 if entry is None else self._cut_capped(plan, prompt, entry))

    def _prompt(self, plan: _Plan, text: RenderedText | None, entry: Entry | None,
                check: bool | None = None) -> TokenIds:
        """The rendered prompt's ids (from the entry's split when its text allows), rendered
        here unless ``text`` is given. ``check``: a sampled full check? (None: drawn here)"""
        if text is None:
            text = self._render(plan)
        if entry is not None and text.empty_tools != entry.empty_tools:
            text = self._rerender(plan, text, entry)
        return self._tokens.tokenize(plan, text, entry, check)

    def _rerender(self, plan: _Plan, text: RenderedText, entry: Entry) -> RenderedText:
        """The prompt again, in the rare case its tools argument is not the probes'."""
        self._events.prompt_rendered()
        try:
            again = self._text.render(plan, plan.messages, _tools(plan, entry), plan.options)
        except TemplateRenderError as exc:
            raise TemplateRenderError(
                f"the template renders this prompt only with tools={'[]' if text.empty_tools else 'None'}"
                f" but its static part only with tools={'[]' if entry.empty_tools else 'None'}; "
                f"pass tools explicitly ({exc})") from exc
        return RenderedText(again, entry.empty_tools)

    def _cut_capped(self, plan: _Plan, prompt: TokenIds, entry: Entry) -> int:
        end, past_cap = self._cut(plan, prompt, entry)
        return self._capped(plan, prompt, entry, end) if past_cap else end

    def _cut(self, plan: _Plan, prompt: TokenIds, entry: Entry) -> tuple[int, bool]:
        """Where the prompt leaves the scaffold (a memcmp on packed ids), and whether that cut
        must still be checked against the first non-static text (only on templates whose
        multi-turn layout moves the static text, for requests not in the probes' shape)."""
        end = boundary.packed_prefix_len(prompt.packed, entry.packed_ids)
        return end, end > entry.cap and not plan.probe_shape

    def _capped(self, plan: _Plan, prompt: TokenIds, entry: Entry, end: int) -> int:
        """``end``, cut at the start of the first non-static message's text: one more render
        with that text replaced."""
        self._events.cap_rendered()
        replaced = boundary.first_text_replaced(plan.messages, plan.n_static)
        try:
            ids = plan.renderer.apply(replaced, _tools(plan, entry), plan.kwargs, plan.options)
        except TemplateRenderError as exc:
            # The template renders this request but not with that text: nothing is known to be
            # static, so nothing is protected.
            log.warning("could not locate the first non-static text (%s); boundary 0", exc)
            return 0
        return min(end, boundary.packed_prefix_len(prompt.packed, pack_ids(ids)))

    def _none(self, plan: _Plan, prompt: TokenIds) -> PrefixResult:
        return self._report(plan, PrefixResult(0, prompt, NONE, ""))

    def _answer(self, plan: _Plan, prompt: TokenIds, end: int, entry: Entry,
                cache: str) -> PrefixResult:
        if cache == HIT:
            self._events.saved(model=plan.model, seconds=entry.render_seconds)
        return self._report(plan, PrefixResult(end, prompt, cache, plan.key, entry.n_static,
                                               plan.renderer.uncacheable))

    def _report(self, plan: _Plan, result: PrefixResult) -> PrefixResult:
        self._events.resolved(cache=result.cache, namespace=plan.namespace, model=plan.model,
                              seconds=time.perf_counter() - plan.started,
                              static_tokens=result.static_tokens,
                              boundary=result.specprefill_system_end)
        return result

    def _read(self, plan: _Plan, value: bytes | None) -> Entry | None:
        """Decode a stored value; anything that is not exactly ours counts as a miss."""
        if value is None:
            return None
        try:
            return self._decode(plan, value)
        except EntryError as exc:
            log.warning("rejected stored entry %s: %s", plan.key, exc)
            self._events.verification_failure()
            return None

    def _await_flight_sync(self, plan: _Plan) -> Entry:
        if not plan.cached:  # computed for this request alone: no flight to share, no store
            return self._compute(plan)[0]
        flight, leader = self._flights.claim(plan.key)
        if leader:
            self._lead(plan, flight)
        else:
            self._events.waited()
        entry: Entry = flight.result()
        return entry

    async def _await_flight(self, plan: _Plan, loop: asyncio.AbstractEventLoop) -> Entry:
        if not plan.cached:
            return (await self._in_thread(loop, self._compute, plan))[0]
        flight, leader = self._flights.claim(plan.key)
        if leader:
            self._in_thread(loop, self._lead, plan, flight)
        else:
            self._events.waited()
        # Shielded: a cancelled request must not cancel the flight others wait on.
        entry: Entry = await asyncio.shield(asyncio.wrap_future(flight))
        return entry

    def _lead(self, plan: _Plan, flight: Future[Entry]) -> None:
        """Compute the scaffold once, store it, publish it to waiters, then end the flight."""
        try:
            try:
                entry = self._recheck(plan)
                if entry is not None:
                    flight.set_result(entry)
                    return
                entry, storable = self._compute(plan)
            except BaseException as exc:  # waiters get the same error the leader got
                flight.set_exception(exc)
                return
            # Store first, then publish: a caller that sees this result and asks again at once
            # must find the entry (a bounded wait: store calls are under a short timeout).
            if storable:
                try:
                    self._put(plan, entry)
                except Exception:  # an unstorable entry still answers this request
                    log.exception("could not store entry %s", plan.key)
            flight.set_result(entry)
        finally:
            if not flight.done():  # never leave waiters hanging
                flight.set_exception(RuntimeError("static-prefix computation was abandoned"))
            self._flights.release(plan.key, flight)

    def _recheck(self, plan: _Plan) -> Entry | None:
        """Another flight may have stored the entry between our read and our claim: one more
        read is far cheaper than the renders it can save."""
        stored = self._get(plan.key)
        try:
            return None if stored is None else self._decode(plan, stored)
        except EntryError:
            return None

    def _decode(self, plan: _Plan, value: bytes) -> Entry:
        """``decode_entry`` (from the decoded-entry memo when accelerated)."""
        return self._decode_entry(value, plan.key, plan.check)

    def _compute(self, plan: _Plan) -> tuple[Entry, bool]:
        """The entry for the plan's key, and whether it may be stored under that key: only if
        every probe rendered on the date the key was made with."""
        started = time.perf_counter()
        renders = 0
        for _ in range(2):  # probes that straddle midnight are rendered again, on one date
            day = plan.renderer.date_tag()
            probed = probe(lambda conv, tools: self._text.render(plan, conv, tools),
                           plan.renderer, plan.static or [], plan.tools,
                           self._tokens.split_rule(plan.renderer))
            renders += probed.renders
            settled = plan.renderer.date_tag() == day
            if settled:
                break
        elapsed = time.perf_counter() - started
        self._events.computed(model=plan.model, seconds=elapsed, static_tokens=len(probed.ids),
                              renders=renders)
        if probed.split_off is not None:
            self._events.fast_path_off(model=plan.model, reason=probed.split_off)
        if settled and day != plan.date:
            log.info("the date changed since the key was made; %s is not stored", plan.key)
        entry = Entry(plan.key, plan.check, pack_ids(probed.ids), elapsed, probed.cap,
                      probed.empty_tools, probed.split)
        # A render that drew at random (caught as it happened) is not stored.
        return entry, settled and day == plan.date and plan.renderer.uncacheable is None

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

    def _put(self, plan: _Plan, entry: Entry) -> None:
        value = encode_entry(plan.key, plan.check, entry.packed_ids, entry.render_seconds,
                             cap=entry.cap, empty_tools=entry.empty_tools, split=entry.split)
        try:
            self.store.put(plan.key, value, self.ttl_seconds)
        except StoreUnavailableError as exc:
            self._store_failed("put", exc)

    def _store_failed(self, op: str, exc: StoreUnavailableError) -> None:
        self._events.store_error(op=op)
        log.warning("store %s failed, computing instead: %s", op, exc)


def _tools(plan: _Plan, entry: Entry) -> list[dict[str, Any]] | None:
    """The ``tools`` argument the entry's probes rendered with."""
    return [] if entry.empty_tools else plan.tools

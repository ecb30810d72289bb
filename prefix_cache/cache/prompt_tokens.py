"""Prefix-aware tokenization of a rendered prompt: the stored static ids up to the entry's safe
split, then the tokenization of the rest of the text only.

    prompt text starts with split.text  ->  stored[:index] + tokenize(text[anchor:])
    otherwise (or no split, or off)     ->  tokenize(text)

Both give the ids of a full tokenization (``split`` says why); at a sampled rate the fast path
is checked against a full tokenization, and a mismatch turns it off for that tokenizer (logged
once, counted), that request getting the full tokenization's ids.

A check renders the prompt the official way and tokenizes all of it (10-30 ms at 64 tools):
at 1% of a busy worker's hits that was more CPU than the hits themselves (issue 30). So below
a rate of 1, checks are also held to ``CHECK_TIME_SHARE`` of the time: a drawn check is skipped
while the checks so far took more than that share of the time since the first draw (the first
drawn check always runs). A systematic mismatch is still found at the first check; under light
load the rate alone decides. A rate of 1 checks every prompt (tests, debugging).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from .entry import Entry
from ..util.hints import FastPath
from .observer import CacheObserver
from ..render.render import TemplateRenderer
from ..render.split import ANCHOR, TEXT_DIFFERS, tail_from_split
from ..util.token_ids import TokenIds, pack_ids, unpack_ids

log = logging.getLogger("prefix_cache")

DEFAULT_CHECK_RATE = 0.01
CHECK_TIME_SHARE = 0.01    # sampled checks take at most this share of the time (rate < 1)

# Why a prompt was tokenized whole (the ``reason`` of a full tokenization).
NO_STATIC = "no_static"        # no static part, so no entry
NO_SPLIT = "no_split"          # the entry has no safe split (tokenizer or static text)
OFF = "off"                    # turned off: for this tokenizer by a failed check, or everywhere
REASONS = (NO_STATIC, NO_SPLIT, TEXT_DIFFERS, OFF, ANCHOR)  # TEXT_DIFFERS, ANCHOR: split's


def validate_check_rate(rate: float) -> float:
    """A sampling rate in [0, 1]; ValueError naming the value otherwise."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"tokenize check rate must be a number in [0, 1], got {rate!r}")
    return float(rate)


class PromptTokenizer:
    """Tokenizes rendered prompts, from an entry's split when it can; checks itself at
    ``check_rate`` (a fraction of fast tokenizations re-done in full and compared)."""

    def __init__(self, events: CacheObserver, check_rate: float = DEFAULT_CHECK_RATE,
                 rng: random.Random | None = None) -> None:
        self.check_rate = validate_check_rate(check_rate)
        self._events = events
        self._rng = rng or random.Random()
        self._off: dict[bytes, str] = {}   # tokenizer fingerprint -> why the fast path is off
        self._lock = threading.Lock()
        self._first_draw: float | None = None
        self._checking_s = 0.0  # what the checks took so far

    def tokenize(self, renderer: TemplateRenderer, text: str, entry: Entry | None,
                 model: str, official: Callable[[], str] | None = None,
                 check: bool | None = None, scope: str = "", fast: FastPath | None = None
                 ) -> TokenIds:
        """The prompt's ids, equal to ``renderer.tokenize(text)``.

        The rule: off (no accelerators) -> the whole text tokenized. Else the stored ids up to
        the entry's split plus the tail tokenized, where the split allows it (``_fast``); a
        call drawn for the sampled check also renders the prompt the official way, tokenizes
        it whole and compares: a different render turns the direct render off, different ids
        turn this tokenizer's fast path off, and either way the whole tokenization is the
        answer. Not drawn: the fast ids when there are some, else the whole tokenization.

        ``official``: the prompt
        rendered through ``apply_chat_template`` itself, for a sampled check of a direct render
        (the direct render) along with the tokenization. ``check``: whether this call is one of
        the sampled checks, drawn beforehand with ``sampled()`` (None: drawn here). ``scope``:
        the tenant whose remembered tail pieces may be used (``fast.tokenize_tail``).
        ``fast``: the accelerators; None when the fast path is off: tokenized whole, nothing
        to check."""
        if fast is None:
            self._events.tokenized(model=model, fast=False, reason=OFF)
            return TokenIds.of_rendered(renderer.tokenize(text))
        ids, reason = self._fast(renderer, text, entry, scope, fast)
        direct = official is not None and renderer.renders_direct
        if check is None:
            check = self.sampled()
        if (ids is None and not direct) or not check:
            if ids is None:
                self._events.tokenized(model=model, fast=False, reason=reason)
                return TokenIds.of_rendered(renderer.tokenize(text))
            self._events.tokenized(model=model, fast=True, reason="")
            return ids
        # The sampled check: the official render, tokenized whole, against what we made.
        started = time.perf_counter()
        reference = official() if official is not None and direct else text
        if ids is None:  # only the render to check
            mismatch = reference != text
            full = renderer.tokenize(reference)
        else:
            full = renderer.tokenize(reference)
            mismatch = full != ids.ids
        self._checking_s += time.perf_counter() - started  # (a lost update only checks more)
        self._events.tokenize_checked(model=model, mismatch=mismatch)
        if mismatch and reference != text:
            renderer.direct_off("a sampled check found that its render differs")
        elif mismatch and ids is not None:
            self._turn_off(renderer, model, full, ids.ids)
        if ids is not None and not mismatch:
            self._events.tokenized(model=model, fast=True, reason="")
            return ids
        self._events.tokenized(model=model, fast=False, reason=reason or OFF)
        return TokenIds.of_rendered(full)

    def sampled(self) -> bool:
        """Whether the next tokenization is checked in full (true at ``check_rate``, within
        the checks' share of the time below a rate of 1)."""
        if self.check_rate >= 1.0:
            return True
        if not self.check_rate:
            return False
        now = time.monotonic()
        if self._first_draw is None:
            self._first_draw = now
        if self._rng.random() >= self.check_rate:
            return False
        return self._checking_s <= CHECK_TIME_SHARE * (now - self._first_draw)

    def _fast(self, renderer: TemplateRenderer, text: str, entry: Entry | None, scope: str,
              fast: FastPath) -> tuple[TokenIds | None, str]:
        if entry is None:
            return None, NO_STATIC
        split = entry.split
        if split is None:
            return None, NO_SPLIT
        if renderer.tokenizer_digest in self._off:
            return None, OFF
        at = entry.packed_ids[4 * split.index: 4 * split.index + 4]
        def tokenize_tail(tail: str) -> list[int]:
            return fast.tokenize_tail(renderer, scope, tail)
        tail, why = tail_from_split(split, unpack_ids(at)[0] if at else None, tokenize_tail, text)
        if tail is None:
            return None, why
        head = entry.packed_ids[: 4 * split.index]
        return TokenIds(None, head + pack_ids(tail)), ""  # a list only if read

    def _turn_off(self, renderer: TemplateRenderer, model: str, full: list[int],
                  fast: list[int]) -> None:
        at = next((i for i, (a, b) in enumerate(zip(full, fast, strict=False)) if a != b),
                  min(len(full), len(fast)))
        reason = f"a sampled check found a mismatch at token {at}"
        with self._lock:
            first = renderer.tokenizer_digest not in self._off
            self._off.setdefault(renderer.tokenizer_digest, reason)
        if first:  # logged once per tokenizer
            log.warning("fast prompt tokenization is off for %s: %s (full tokenization from "
                        "now on; please report this tokenizer)", model, reason)
            self._events.fast_path_off(model=model, reason=reason)

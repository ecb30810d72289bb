"""The accelerated prompt tokenizer of a cache: ``PromptTokenizer``'s ids, from the entry's
split (``prefix_cache.cache.prompt_tokens`` describes the rule and the sampled checks).

A hit's tail is tokenized piece by piece, pieces remembered per tenant (``_tail_pieces``).
A sampled check renders the prompt the plain way and tokenizes it whole: a different render
turns the direct render off for that renderer (``FastPromptText.direct_off``), different ids
turn the split off for that tokenizer (logged once, counted); the check's ids are the answer.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from ..cache.entry import Entry
from ..cache.prompt_tokens import (
    CHECK_TIME_SHARE,
    DEFAULT_CHECK_RATE,
    NO_SPLIT,
    NO_STATIC,
    OFF,
    Plan,
    PromptTokenizer,
    RenderedText,
    validate_check_rate,
)
from ..render.render import TemplateRenderer
from ..render.split import SplitRule, tail_from_split
from ..render.tokenizer_model import TokenizerModel
from ..util.token_ids import TokenIds, pack_ids, unpack_ids
from ._fast_text import FastPromptText
from ._tail_pieces import PieceMemo

log = logging.getLogger("prefix_cache")
MAX_RULES = 64   # tokenizer states whose split rule one tokenizer keeps


class FastPromptTokenizer(PromptTokenizer):
    """Tokenizes rendered prompts from an entry's split when it can; checks itself at
    ``check_rate`` (a fraction of its tokenizations re-done in full and compared)."""

    inline_hits = True

    def __init__(self, plain: PromptTokenizer, text: FastPromptText,
                 check_rate: float = DEFAULT_CHECK_RATE, rng: random.Random | None = None
                 ) -> None:
        super().__init__(plain.events)
        self.plain, self.text = plain, text
        self.check_rate = validate_check_rate(check_rate)
        self.pieces = PieceMemo()
        self._rng = rng or random.Random()
        self._off: dict[bytes, str] = {}   # tokenizer fingerprint -> why the split is off
        self._rules: dict[bytes, SplitRule] = {}   # tokenizer fingerprint -> its split rule
        self._lock = threading.Lock()
        self._first_draw: float | None = None
        self._checking_s = 0.0  # what the checks took so far

    def tokenize(self, plan: Plan, text: RenderedText, entry: Entry | None,
                 check: bool | None = None) -> TokenIds:
        """The prompt's ids, equal to the plain tokenizer's.

        The rule: the stored ids up to the entry's split plus the tail tokenized, where the
        split allows it (``_from_split``); a call drawn for the sampled check (``check``, or
        drawn here when None) also renders the prompt the plain way, tokenizes it whole and
        compares: a different render turns the direct render off, different ids turn this
        tokenizer's split off, and either way the whole tokenization is the answer. Not
        drawn: the split's ids when there are some, else the whole tokenization."""
        renderer, events = plan.renderer, self.events
        ids, reason = self._from_split(renderer, text.text, entry, plan.namespace)
        direct = self.text.renders_direct(renderer)
        if check is None:
            check = self.sampled()
        if (ids is None and not direct) or not check:
            if ids is None:
                events.tokenized(model=plan.model, fast=False, reason=reason)
                return TokenIds.of_rendered(renderer.tokenize(text.text))
            events.tokenized(model=plan.model, fast=True, reason="")
            return ids
        # The sampled check: the plain render, tokenized whole, against what we made.
        started = time.perf_counter()
        reference = text.text
        if direct:
            tools = [] if text.empty_tools else plan.tools
            reference = self.text.plain.render(plan, plan.messages, tools, plan.options)
        full = renderer.tokenize(reference)
        mismatch = reference != text.text if ids is None else full != ids.ids
        self._checking_s += time.perf_counter() - started  # (a lost update only checks more)
        events.tokenize_checked(model=plan.model, mismatch=mismatch)
        if mismatch and reference != text.text:
            self.text.direct_off(renderer, "a sampled check found that its render differs")
        elif mismatch and ids is not None:
            self._turn_off(renderer, plan.model, full, ids.ids)
        if ids is not None and not mismatch:
            events.tokenized(model=plan.model, fast=True, reason="")
            return ids
        events.tokenized(model=plan.model, fast=False, reason=reason or OFF)
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

    def split_rule(self, renderer: TemplateRenderer) -> SplitRule | None:
        """The renderer's tokenizer's rule, built once per tokenizer state (its fingerprint)."""
        digest = renderer.tokenizer_digest
        rule = self._rules.get(digest)
        if rule is None:
            model = renderer.tokenizer_model or TokenizerModel(renderer.tokenizer,
                                                               renderer.split_special_tokens)
            rule = SplitRule(model)
            with self._lock:
                if len(self._rules) >= MAX_RULES:
                    del self._rules[next(iter(self._rules))]
                self._rules[digest] = rule
        return rule

    def _from_split(self, renderer: TemplateRenderer, text: str, entry: Entry | None,
                    scope: str) -> tuple[TokenIds | None, str]:
        if entry is None:
            return None, NO_STATIC
        split = entry.split
        if split is None:
            return None, NO_SPLIT
        if renderer.tokenizer_digest in self._off:
            return None, OFF
        at = entry.packed_ids[4 * split.index: 4 * split.index + 4]
        def tokenize_tail(tail: str) -> list[int]:
            return self.pieces.tokenize(renderer, scope, tail)
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
            self.events.fast_path_off(model=model, reason=reason)

"""Grammars compiled once per namespace, grammar text and tokenizer, kept in a bounded LRU;
each request gets a fresh copy of the compiled matcher (``deep_copy``: microseconds, not a
compile).

The key is the project's: the namespace (a tenant never gets another's compiled grammar, so the
time to its first token cannot tell it what another sent: ARCHITECTURE.md invariant 5; a purge
drops the namespace's), xxhash (xxh3-128) of the grammar's bytes and the tokenizer's fingerprint
(``prefix_cache.render.tokenizer_identity``), so a tokenizer changed after first use gets its own
entries (and its own llguidance tokenizer).

What a grammar would refuse is found before anything runs, as a 400: a grammar text over
``MAX_GRAMMAR_TEXT_BYTES`` is not compiled; a compiled one walks its first steps (``_first_steps``:
the forced tokens, and a few of the allowed ones at each branch), so one that compiles but cannot
run (a row of Earley items past llguidance's limit as soon as an object with thousands of
optional properties opens) is refused instead of failing at its first token as a 500.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import llguidance.hf
import xxhash

from prefix_cache.errors import InvalidRequestError
from prefix_cache.render.render import unwrap_tokenizer
from prefix_cache.render.tokenizer_identity import TokenizerStates
from prefix_cache.util.lru import ByteLRU

from ..purge_marks import PurgeMarks, stamp
from .build import UNSUPPORTED, OutputGrammar

DEFAULT_MAX_GRAMMARS = 128
# Grammar text is the size counted: compiled state grows with it.
DEFAULT_MAX_GRAMMAR_BYTES = 64 << 20
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# The largest grammar text compiled (Lark, as ``build.py`` writes it): a schema's size is what
# its compile time grows with (3,500 required properties, ~130 KB, compile in ~2 s; 10,000
# optional ones took 107 s). Past it, a 400 naming the limit.
MAX_GRAMMAR_TEXT_BYTES = 128 << 10
TOO_LARGE = "grammar_too_large"
CANNOT_RUN = "grammar_cannot_run"
# ``_first_steps``: how many tokens deep, and how many of the allowed tokens at each step.
PROBE_DEPTH, PROBE_WIDTH = 3, 4


@dataclass(slots=True)
class GrammarRun:
    """One request's grammar state: its matcher (touched only on the engine thread, once
    submitted) and the first token it refused (written there, read by the backend)."""

    matcher: Any
    eos_ids: tuple[int, ...]    # what may follow a complete grammar
    error: str | None = None


class GrammarCache:
    """Compiled grammars of one model's tokenizer (``vocab_size`` rows of logits, ``eos_ids``
    the tokens that end a turn: allowed once the grammar is complete)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int],
                 max_entries: int = DEFAULT_MAX_GRAMMARS) -> None:
        self.tokenizer = unwrap_tokenizer(tokenizer)
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.compiles = self.hits = 0
        self.compiling = 0          # compiles running now (API handlers' threads)
        self.tokenizer_builds = 0   # llguidance tokenizers built (``prepare``, or a first grammar)
        self._lru: ByteLRU[tuple[str, str], Any] = ByteLRU(DEFAULT_MAX_GRAMMAR_BYTES, max_entries)
        self._ll_tokenizers: dict[bytes, Any] = {}
        self._purges = PurgeMarks()
        self._lock = threading.Lock()  # callers are API handlers on several threads
        self._states = TokenizerStates()  # the tokenizer's state, re-read per grammar

    def run(self, grammar: OutputGrammar, namespace: str = "default") -> GrammarRun:
        """A fresh run of the grammar (``matcher``: an ``LLMatcher``)."""
        return GrammarRun(self.matcher(grammar, namespace), tuple(self.eos_ids))

    def matcher(self, grammar: OutputGrammar, namespace: str = "default") -> Any:
        """A fresh ``LLMatcher`` for the grammar, compiled once per namespace;
        InvalidRequestError naming the part that cannot compile, or what the grammar would
        refuse (its size past ``MAX_GRAMMAR_TEXT_BYTES``, a first step past llguidance's
        limits)."""
        if not self.eos_ids:
            raise InvalidRequestError("constrained decoding (a JSON format, tool_choice) needs the "
                                      "model's end-of-turn token, and this one has none",
                                      code=UNSUPPORTED)
        size = len(grammar.lark.encode())
        if size > MAX_GRAMMAR_TEXT_BYTES:
            raise InvalidRequestError(
                f"the output's grammar (a JSON schema, tools) is {size} bytes as a grammar, over "
                f"the limit of {MAX_GRAMMAR_TEXT_BYTES} bytes ({MAX_GRAMMAR_TEXT_BYTES >> 10} "
                "KiB) this engine compiles: send a smaller schema", code=TOO_LARGE)
        fingerprint = self._states.fingerprint(self.tokenizer)
        key = (namespace, xxhash.xxh3_128_hexdigest(grammar.lark.encode()) + fingerprint.hex())
        issued = stamp()   # a purge of the namespace while this compiles: not kept after it
        with self._lock:
            template = self._lru.get(key)
            if template is not None:
                self.hits += 1
                return template.deep_copy()
            ll_tokenizer = self._ll_tokenizer(fingerprint)
            self.compiling += 1
        try:
            template = self._compile(grammar, ll_tokenizer)
        finally:
            with self._lock:
                self.compiling -= 1
                self.compiles += 1
        with self._lock:
            if not self._purges.since(namespace, issued):
                self._lru.put(key, template, len(grammar.lark))
        return template.deep_copy()

    def purge(self, namespace: str | None = None) -> int:
        """Drop a namespace's compiled grammars (None: every one); the number dropped."""
        with self._lock:
            self._purges.mark(namespace)
            doomed = self._lru.pop_where(lambda k, _: namespace is None or k[0] == namespace)
        return len(doomed)

    def prepare(self) -> None:
        """Build the llguidance tokenizer now, so the first request under a grammar (any
        request with tools) does not wait for it."""
        with self._lock:
            self._ll_tokenizer(self._states.fingerprint(self.tokenizer))

    def _ll_tokenizer(self, fingerprint: bytes) -> Any:
        ll = self._ll_tokenizers.get(fingerprint)
        if ll is None:  # about 0.4 s for a 49k vocabulary: once per tokenizer state
            self._ll_tokenizers.clear()
            ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                              eos_token=self.eos_ids or None)
            self._ll_tokenizers[fingerprint] = ll
            self.tokenizer_builds += 1
        return ll

    def _compile(self, grammar: OutputGrammar, ll_tokenizer: Any) -> Any:
        lark = llguidance.LLMatcher.grammar_from_lark(grammar.lark)
        matcher = llguidance.LLMatcher(ll_tokenizer, lark, log_level=0, limits=LIMITS)
        if not matcher.is_error():
            refused = _first_steps(matcher)
            if refused is not None:
                raise InvalidRequestError(
                    "the output's grammar compiles but cannot run within this engine's limits "
                    f"for constrained decoding ({_reason(refused)}): an object with fewer "
                    "optional properties (make them required), or a smaller schema",
                    code=CANNOT_RUN)
            return matcher
        for field, part in grammar.parts:  # which one: each compiled alone
            alone = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(part),
                                         log_level=0, limits=LIMITS)
            if alone.is_error():
                raise InvalidRequestError(f"{field}: not supported by this engine's constrained "
                                          f"decoding: {_reason(alone.get_error())}",
                                          code=UNSUPPORTED)
        raise InvalidRequestError("the output's grammar could not be compiled: "
                                  f"{_reason(matcher.get_error())}", code=UNSUPPORTED)


def _first_steps(template: Any) -> str | None:
    """The error of the grammar's first steps, on copies of ``template``, or None: at each
    step the tokens it forces, then up to ``PROBE_WIDTH`` of those it allows, ``PROBE_DEPTH``
    deep. What fails here would fail the request at its first tokens."""
    frontier = [template.deep_copy()]
    for _ in range(PROBE_DEPTH):
        following = []
        for matcher in frontier:
            forced = matcher.compute_ff_tokens()
            if forced:
                matcher.consume_tokens(forced)
            mask = None if matcher.is_error() else matcher.compute_bitmask()
            if matcher.is_error():
                return str(matcher.get_error())
            if matcher.is_stopped():
                continue
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8),
                                                   bitorder="little"))
            for token in allowed[:PROBE_WIDTH]:
                step = matcher.deep_copy()
                step.consume_token(int(token))
                if step.is_error():
                    return str(step.get_error())
                following.append(step)
        frontier = following[:PROBE_WIDTH]
    return None


def _reason(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    detail = next((line for line in lines if line.startswith("error:")), "")
    return " ".join(filter(None, [lines[0] if lines else "unknown error", detail]))[:300]

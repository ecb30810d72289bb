"""Grammars compiled once per grammar text and tokenizer, kept in a bounded LRU; each request
gets a fresh copy of the compiled matcher (``deep_copy``: microseconds, not a compile).

The key is the project's: xxhash (xxh3-128) of the grammar's bytes and the tokenizer's
fingerprint (``prefix_cache.render.tokenizer_identity``), so a tokenizer changed after first use gets
its own entries (and its own llguidance tokenizer).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import xxhash

from prefix_cache.errors import InvalidRequestError
from prefix_cache.render.render import unwrap_tokenizer
from prefix_cache.render.tokenizer_identity import TokenizerStates
from prefix_cache.util.lru import ByteLRU

from .build import UNSUPPORTED, OutputGrammar

DEFAULT_MAX_GRAMMARS = 128
# Grammar text is the size counted: compiled state grows with it.
DEFAULT_MAX_GRAMMAR_BYTES = 64 << 20
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


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
        self.tokenizer_builds = 0   # llguidance tokenizers built (``prepare``, or a first grammar)
        self._lru: ByteLRU[str, Any] = ByteLRU(DEFAULT_MAX_GRAMMAR_BYTES, max_entries)
        self._ll_tokenizers: dict[bytes, Any] = {}
        self._lock = threading.Lock()  # callers are API handlers on several threads
        self._states = TokenizerStates()  # the tokenizer's state, re-read per grammar

    def run(self, grammar: OutputGrammar) -> GrammarRun:
        """A fresh run of the grammar (``matcher``: an ``LLMatcher``)."""
        return GrammarRun(self.matcher(grammar), tuple(self.eos_ids))

    def matcher(self, grammar: OutputGrammar) -> Any:
        """A fresh ``LLMatcher`` for the grammar; InvalidRequestError naming the part that
        cannot compile."""
        if not self.eos_ids:
            raise InvalidRequestError("constrained decoding (a JSON format, tool_choice) needs the "
                                      "model's end-of-turn token, and this one has none",
                                      code=UNSUPPORTED)
        fingerprint = self._states.fingerprint(self.tokenizer)
        key = xxhash.xxh3_128_hexdigest(grammar.lark.encode()) + fingerprint.hex()
        with self._lock:
            template = self._lru.get(key)
            if template is not None:
                self.hits += 1
                return template.deep_copy()
            ll_tokenizer = self._ll_tokenizer(fingerprint)
        template = self._compile(grammar, ll_tokenizer)
        with self._lock:
            self.compiles += 1
            self._lru.put(key, template, len(grammar.lark))
        return template.deep_copy()

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


def _reason(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    detail = next((line for line in lines if line.startswith("error:")), "")
    return " ".join(filter(None, [lines[0] if lines else "unknown error", detail]))[:300]

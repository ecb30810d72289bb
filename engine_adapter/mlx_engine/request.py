"""What goes into the engine (a request) and what comes out (token events)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from prefix_cache.engine.protocol import BackendError, EngineCounts
from prefix_cache.errors import ContextLengthError, InvalidRequestError
from prefix_cache.util.token_ids import validate_token_ids

from ..defaults import DEFAULT_MAX_TOKENS, GREEDY
from ..purge_marks import stamp

if TYPE_CHECKING:  # the run's type only: the engine never imports llguidance itself
    from ..grammar.compiled import GrammarRun

SEED_MAX = 2**64 - 1
Limits = tuple[int | None, int | None]  # (vocab_size, context_length) a request is checked for
PROMPT_IDS_CODE = "invalid_prompt_token_ids"  # a 400's code: the prompt's ids are to blame


def _new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One completion: prompt token ids, the static-prefix boundary, sampling, a namespace.
    The engine's one request type: ``checked`` makes the copy an engine runs as it is.

    ``specprefill`` None means "on when the engine has a draft model and more than the
    threshold of tokens follow the boundary"; False turns it off, True asks for it (a request
    still gets dense prefill when the engine has no draft). ``stop_token_ids`` None uses the
    engine's (the model's end-of-turn tokens). ``grammar`` constrains the output (see
    ``sampling.GrammarSampler``).
    """

    prompt_ids: Sequence[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    specprefill_system_end: int = 0
    namespace: str = "default"
    temperature: float = GREEDY
    top_p: float = 1.0
    seed: int | None = None
    specprefill: bool | None = None
    specprefill_keep_pct: float | None = None
    specprefill_threshold: int | None = None
    stop_token_ids: Sequence[int] | None = None
    return_logprobs: bool = False
    request_id: str = field(default_factory=_new_id)
    # A ``grammar.GrammarRun`` (a fresh llguidance matcher) every generated token must satisfy
    # (None: free text); the engine's sampler advances it, so one serves one request.
    grammar: GrammarRun | None = None
    # When it was made (``purge_marks.stamp``): its KV is not stored once its namespace has
    # been purged since, so a purge that answered is not undone by a request still running.
    issued: int = field(default_factory=stamp)
    # The limits ``checked`` checked it for (None: not checked). Not an argument, so no caller
    # can mark a request checked without the check: ids outside the vocabulary would fail the
    # model step on the engine's thread instead of answering a 400.
    limits: Limits | None = field(default=None, init=False, compare=False, repr=False)

    def checked(self, vocab_size: int | None, context_length: int | None) -> GenerationRequest:
        """A copy checked for an engine's limits (``validate``; its prompt ids a list), which
        ``MLXEngine.submit``, ``generate`` and ``agenerate`` run as it is: the one place a
        checked request is made."""
        checked = replace(self, prompt_ids=self.validate(vocab_size, context_length))
        object.__setattr__(checked, "limits", (vocab_size, context_length))  # frozen: set once
        return checked

    def validate(self, vocab_size: int | None = None,
                 context_length: int | None = None) -> list[int]:
        """The prompt ids as a list; InvalidRequestError (a ValueError) naming the first bad
        field. The prompt plus ``max_tokens`` must fit in ``context_length`` when it is given."""
        ids = validate_token_ids(self.prompt_ids, "prompt_ids")
        check_vocabulary(ids, vocab_size, "prompt_ids")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if context_length is not None:
            check_context(len(ids), self.max_tokens, context_length)
        end = self.specprefill_system_end
        if not isinstance(end, int) or not 0 <= end <= len(ids):
            raise InvalidRequestError(f"specprefill_system_end must be in [0, {len(ids)}], got {end!r}")
        if not isinstance(self.namespace, str) or not self.namespace:
            raise InvalidRequestError(f"namespace must be a non-empty string, got {self.namespace!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        seed = self.seed  # the PRNG key is 64 bits: a larger seed would fail the model step
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not 0 <= seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must be an integer in [0, {SEED_MAX}], got {seed!r}")
        if self.specprefill_keep_pct is not None and not 0.0 < self.specprefill_keep_pct <= 1.0:
            raise InvalidRequestError(f"specprefill_keep_pct must be in (0, 1], got {self.specprefill_keep_pct}")
        if self.specprefill_threshold is not None and self.specprefill_threshold < 0:
            raise InvalidRequestError(f"specprefill_threshold must be >= 0, got {self.specprefill_threshold}")
        return ids


def check_vocabulary(ids: list[int], vocab_size: int | None, what: str) -> None:
    """InvalidRequestError unless there are ids and every one has an embedding row."""
    if not ids:
        raise InvalidRequestError(f"{what} must be a non-empty list of token ids",
                                  code=PROMPT_IDS_CODE)
    if vocab_size is not None and max(ids) >= vocab_size:
        raise InvalidRequestError(f"{what} has id {max(ids)}, outside the model's vocabulary "
                                  f"({vocab_size})", code=PROMPT_IDS_CODE)


def check_context(prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """ContextLengthError unless the prompt and ``max_tokens`` generated tokens fit."""
    sizes = {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
             "context_length": context_length}
    if prompt_tokens >= context_length:
        raise ContextLengthError(f"the prompt has {prompt_tokens} tokens; the model's context is "
                                 f"{context_length} tokens, and at least one must be left to "
                                 "generate", **sizes)
    if prompt_tokens + max_tokens > context_length:
        raise ContextLengthError(f"the prompt ({prompt_tokens} tokens) plus max_tokens "
                                 f"({max_tokens}) is {prompt_tokens + max_tokens} tokens, over "
                                 f"the model's context of {context_length}; ask for at most "
                                 f"{context_length - prompt_tokens}", **sizes)


DENSE, SPECPREFILL = "dense", "specprefill"


@dataclass(frozen=True, slots=True)
class PrefillInfo:
    """How a request's prompt got into the target's KV cache."""

    prompt_tokens: int
    static_tokens: int         # the boundary used: min(specprefill_system_end, prompt_tokens - 1)
    reused_tokens: int         # restored (static-prefix or conversation store), not computed
    prefilled_tokens: int      # target-model tokens computed for this prompt
    mode: str                  # DENSE or SPECPREFILL
    kept_tokens: int | None = None   # SpecPrefill: tokens kept after the protected part
    fallback: str | None = None      # why SpecPrefill was wanted but dense ran
    conversation_tokens: int = 0     # of reused_tokens: restored from an earlier prompt (dense)
    reply_tokens: int = 0            # of conversation_tokens: an earlier reply's, sent back

    def tally(self, stats: EngineCounts) -> None:
        """Add this prefill to the engine's counts."""
        stats.specprefill += self.mode == SPECPREFILL
        stats.conversation_hits += self.conversation_tokens > 0
        stats.reused_tokens += self.reused_tokens
        stats.reused_generated_tokens += self.reply_tokens
        stats.prefilled_tokens += self.prefilled_tokens


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token; the last one of a request has a finish_reason."""

    request_id: str
    token: int
    index: int                          # 0 for the first generated token
    finish_reason: str | None = None    # "stop", "length" or None
    elapsed_s: float = 0.0              # since the request was submitted (index 0: the TTFT)
    logprobs: Any | None = None         # mx.array (vocab,) when the request asked for them
    prefill: PrefillInfo | None = None  # on the first event only


class EngineError(BackendError):
    """The engine could not run a request (it was closed, or the model step failed)."""

"""The cache's prompt tokenizer: a rendered prompt's ids.

``PromptTokenizer`` is the plain one: the whole text tokenized. The accelerated one
(``prefix_cache.fastpath``'s ``FastPromptTokenizer``) wraps it and tokenizes from the entry's
safe split, the stored static ids up to it and then the rest of the text only:

    prompt text starts with split.text  ->  stored[:index] + tokenize(text[anchor:])
    otherwise (or no split, or off)     ->  tokenize(text)

Both give the ids of a full tokenization (``split`` says why); at a sampled rate the fast path
is checked against a full tokenization, and a mismatch turns it off for that tokenizer (logged
once, counted), that request getting the full tokenization's ids. ``StaticPrefixCache`` picks
one of the two when it is made.

A check renders the prompt the official way and tokenizes all of it (10-30 ms at 64 tools):
at 1% of a busy worker's hits that was more CPU than the hits themselves (issue 30). So below
a rate of 1, checks are also held to ``CHECK_TIME_SHARE`` of the time: a drawn check is skipped
while the checks so far took more than that share of the time since the first draw (the first
drawn check always runs). A systematic mismatch is still found at the first check; under light
load the rate alone decides. A rate of 1 checks every prompt (tests, debugging).
"""

from __future__ import annotations

from ..render.render import TemplateRenderer
from ..render.split import ANCHOR, TEXT_DIFFERS, SplitRule
from ..util.token_ids import TokenIds
from ._plan import Plan
from ._result import RenderedText
from .entry import Entry
from .observer import CacheObserver

__all__ = ["ANCHOR", "CHECK_TIME_SHARE", "DEFAULT_CHECK_RATE", "NO_SPLIT", "NO_STATIC", "OFF",
           "REASONS", "TEXT_DIFFERS", "Plan", "PromptTokenizer", "RenderedText",
           "validate_check_rate"]  # Plan, RenderedText: what the tokenizers take

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
    """Tokenizes rendered prompts whole (the plain path): nothing to check, no split."""

    # Whether a hit with a short dynamic part is tokenized on the event loop (cheaper than a
    # thread hop only when tokenized from the split).
    inline_hits = False

    def __init__(self, events: CacheObserver) -> None:
        self.events = events

    def tokenize(self, plan: Plan, text: RenderedText, entry: Entry | None,
                 check: bool | None = None) -> TokenIds:
        """The prompt's ids: ``renderer.tokenize(text)`` of the whole text (``entry`` and
        ``check`` are the accelerated tokenizer's)."""
        self.events.tokenized(model=plan.model, fast=False, reason=OFF)
        return TokenIds.of_rendered(plan.renderer.tokenize(text.text))

    def sampled(self) -> bool:
        """Whether the next tokenization is checked in full (never: it is the full one)."""
        return False

    def split_rule(self, renderer: TemplateRenderer) -> SplitRule | None:
        """Where prompts of this renderer may be cut (None: they are not cut)."""
        return None

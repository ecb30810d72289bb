"""A change counter for Rust tokenizers: the number of calls, in this process, of the methods of
``tokenizers.Tokenizer`` that change its added vocabulary (``add_tokens``,
``add_special_tokens``, ``train``, ``train_from_iterator``, ``__setstate__``).

Why: the tokenizer's identity is re-checked on every request (``tokenizer_identity``), and the
only way to read a Rust tokenizer's added-tokens table is to have it build that whole table as
Python objects (~0.13 us per added token, ~50 us on Llama 3.1's 256, with the compare). None of
its cheap readings sees every change (a vocabulary word made an added token, or an added token
re-added with other flags, changes no count). Every such change goes through one of these
methods, which transformers calls on its backend as any caller does (through the class
attribute), so while the counter has not moved since the last full comparison, the table has not
changed. The methods are wrapped once, in place on the class, and otherwise behave as before; the
counter moves after each call returns (or raises), so a reader that saw the old count compares
the table again on its next call.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

# The methods of tokenizers.Tokenizer that can change what its added-tokens table holds.
MUTATORS = ("add_tokens", "add_special_tokens", "train", "train_from_iterator", "__setstate__")
_WRAPPED = "__prefix_cache_watched__"

_changes = itertools.count(1)   # next() is atomic under the GIL
_generation = 0
_lock = threading.Lock()
_watched: type | None = None


def generation() -> int:
    """How many watched calls have returned so far (0 until one has)."""
    return _generation


def watches(backend: Any) -> bool:
    """Whether ``backend``'s mutators are counted (it is a ``tokenizers.Tokenizer``)."""
    watched = watched_class()
    return watched is not None and type(backend) is watched


def watched_class() -> type | None:
    """``tokenizers.Tokenizer`` with its mutators counted (wrapped on the first call); None
    where the class cannot be wrapped (the caller then compares the whole table every time)."""
    global _watched
    if _watched is not None:
        return _watched
    with _lock:
        if _watched is None:
            try:
                import tokenizers
            except ImportError:
                return None
            cls = tokenizers.Tokenizer
            try:
                for name in MUTATORS:
                    method = getattr(cls, name)
                    if not getattr(method, _WRAPPED, False):
                        setattr(cls, name, _counted(method))
            except (AttributeError, TypeError):  # an immutable type: nothing was counted
                return None
            _watched = cls
    return _watched


def _counted(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        global _generation
        try:
            return method(*args, **kwargs)
        finally:
            _generation = next(_changes)

    setattr(call, _WRAPPED, True)
    return call

"""A tokenizer's identity in the key: a stable fingerprint of everything that can change how it
renders and tokenizes, computed once per tokenizer state and re-checked cheaply on every call
(vocabulary size, special tokens, ``split_special_tokens``, the added-tokens table and its
flags), so a tokenizer changed after first use (``add_tokens``) gets a new one.

With the accelerators (``FastPath.added_token_changes``), the added-tokens table of a fast
tokenizer is compared again only when a call that can change it has returned since the last
comparison; without them, on every call. Every other field is read on every call.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from ..util.hints import FastPath

__all__ = ["TokenizerState", "current_fingerprint", "current_state", "encode_settings",
           "quick_settings", "tokenizer_fingerprint"]

def encode_settings(tokenizer: Any) -> tuple[Any, ...]:
    """What can change how an already fingerprinted tokenizer encodes, read in microseconds: its
    backend object, vocabulary size with added tokens, special tokens (template variables),
    ``split_special_tokens``, and the added-tokens table with every token's flags.

    The table is what ``add_tokens`` changes even when the vocabulary size does not (a token
    already in the vocabulary made an added one, or an added token re-added with other flags).
    It is compared whole (``AddedToken`` equality covers content, special, normalized, lstrip,
    rstrip and single_word): about 0.4 us per added token (docs/benchmarks.md)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    table = (backend.get_added_tokens_decoder() if backend is not None
             else dict(getattr(tokenizer, "added_tokens_decoder", {})))
    return (
        id(backend),
        len(tokenizer),
        bool(getattr(tokenizer, "split_special_tokens", False)),
        tokenizer.special_tokens_map,
        table,
    )


def tokenizer_fingerprint(tokenizer: Any, split_special_tokens: bool | None = None) -> bytes:
    """Stable digest of everything that can change how this tokenizer renders and tokenizes.

    Covers the tokenizer class, its full serialized backend (vocab, merges, normalizer,
    pre-tokenizer, added tokens and their flags), the special-token strings templates see as
    variables, the encode-time settings transformers reads on each call, and the transformers
    and Jinja versions (the render engine). ``split_special_tokens``: the flag as the caller
    already read it (read here when None), so the fingerprint names the state that was read.
    """
    import jinja2
    import transformers

    h = xxhash.xxh3_128()
    for part in (
        type(tokenizer).__qualname__,
        transformers.__version__,
        jinja2.__version__,
    ):
        h.update(part.encode() + b"\x00")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary, model file and flags are what it encodes with
        h.update(orjson.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])))
        model = getattr(tokenizer, "sp_model", None)
        if model is not None and hasattr(model, "serialized_model_proto"):
            h.update(model.serialized_model_proto())
    h.update(b"\x00")
    settings = {
        "special_tokens": tokenizer.special_tokens_map,
        "split_special_tokens": (bool(getattr(tokenizer, "split_special_tokens", False))
                                 if split_special_tokens is None else split_special_tokens),
        **{name: getattr(tokenizer, name) for name in _SLOW_FLAGS if hasattr(tokenizer, name)},
    }
    h.update(orjson.dumps(settings, default=repr, option=orjson.OPT_SORT_KEYS))
    return h.digest()


# Encode-time flags of slow (Python) tokenizers; a fast tokenizer's live in its backend.
_SLOW_FLAGS = ("legacy", "add_prefix_space", "do_lower_case", "add_dummy_prefix",
               "sp_model_kwargs", "spaces_between_special_tokens")


class _Memo:
    """One tokenizer's state, the full settings it was made from, and the quick reading
    under which those settings were last compared."""

    __slots__ = ("quick", "settings", "state")

    def __init__(self, quick: tuple[Any, ...] | None, settings: tuple[Any, ...],
                 state: TokenizerState) -> None:
        self.quick = quick
        self.settings = settings
        self.state = state


def quick_settings(tokenizer: Any, fast: FastPath) -> tuple[Any, ...] | None:
    """What changes whenever ``encode_settings`` may have changed, read in about a microsecond:
    the backend object, the count of watched calls (``fast.added_token_changes``: what changes
    the added-tokens table), the backend's base vocabulary size, ``split_special_tokens`` and
    the special tokens. None for a tokenizer without a watched Rust backend (a slow one): its
    table is compared on every call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    changes = None if backend is None else fast.added_token_changes(backend)
    if changes is None:
        return None
    return (
        backend,  # the object, not its id: the memo keeps it, so no new one takes its address
        changes,
        backend.get_vocab_size(with_added_tokens=False),
        bool(getattr(tokenizer, "split_special_tokens", False)),
        tokenizer.special_tokens_map,
    )


_fingerprints: weakref.WeakKeyDictionary[Any, _Memo] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class TokenizerState:
    """What one call reads of a tokenizer, once, at the moment its key is made: the fingerprint,
    and the encode-time flag every later step of that call must use (transformers copies
    ``split_special_tokens`` to its Rust backend only on its next encode, so the backend's own
    flag may still be the old one)."""

    fingerprint: bytes
    split_special_tokens: bool


def current_fingerprint(tokenizer: Any, *, fast: FastPath | None = None) -> bytes:
    """The tokenizer's fingerprint (``current_state``)."""
    return current_state(tokenizer, fast=fast).fingerprint


def current_state(tokenizer: Any, *, fast: FastPath | None = None) -> TokenizerState:
    """The tokenizer's state, its fingerprint recomputed only when its encode settings changed;
    those are compared in full only when the quick reading (``fast``'s) says they may have
    (without ``fast``: always)."""
    quick = quick_settings(tokenizer, fast) if fast is not None else None
    memo = _fingerprints.get(tokenizer)  # (quick is read first: a change in between is seen
    if memo is not None and quick is not None and memo.quick == quick:  # by the next call)
        return memo.state
    settings = encode_settings(tokenizer)
    if memo is not None and memo.settings == settings:
        memo.quick = quick
        return memo.state
    with _lock:  # fingerprinting a large vocab takes a while: once per tokenizer state
        memo = _fingerprints.get(tokenizer)
        if memo is None or memo.settings != settings:
            split = settings[2]
            state = TokenizerState(tokenizer_fingerprint(tokenizer, split), split)
            memo = _fingerprints[tokenizer] = _Memo(quick, settings, state)
        else:
            memo.quick = quick
    return memo.state

"""A tokenizer's identity in the key: a stable fingerprint of everything that can change how it
renders and tokenizes, computed once per tokenizer state and re-checked cheaply on every call
(vocabulary size, special tokens, ``split_special_tokens``, the added-tokens table and its
flags), so a tokenizer changed after first use (``add_tokens``) gets a new one.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import orjson
import xxhash

__all__ = ["current_fingerprint", "encode_settings", "tokenizer_fingerprint"]

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


def tokenizer_fingerprint(tokenizer: Any) -> bytes:
    """Stable digest of everything that can change how this tokenizer renders and tokenizes.

    Covers the tokenizer class, its full serialized backend (vocab, merges, normalizer,
    pre-tokenizer, added tokens and their flags), the special-token strings templates see as
    variables, the encode-time settings transformers reads on each call, and the transformers
    and Jinja versions (the render engine).
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
        "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False)),
        **{name: getattr(tokenizer, name) for name in _SLOW_FLAGS if hasattr(tokenizer, name)},
    }
    h.update(orjson.dumps(settings, default=repr, option=orjson.OPT_SORT_KEYS))
    return h.digest()


# Encode-time flags of slow (Python) tokenizers; a fast tokenizer's live in its backend.
_SLOW_FLAGS = ("legacy", "add_prefix_space", "do_lower_case", "add_dummy_prefix",
               "sp_model_kwargs", "spaces_between_special_tokens")


_fingerprints: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], bytes]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()


def current_fingerprint(tokenizer: Any) -> bytes:
    """The tokenizer's fingerprint, recomputed only when its encode settings changed."""
    settings = encode_settings(tokenizer)
    memo = _fingerprints.get(tokenizer)
    if memo is not None and memo[0] == settings:
        return memo[1]
    with _lock:  # fingerprinting a large vocab takes a while: once per tokenizer state
        memo = _fingerprints.get(tokenizer)
        if memo is None or memo[0] != settings:
            memo = _fingerprints[tokenizer] = (settings, tokenizer_fingerprint(tokenizer))
    return memo[1]

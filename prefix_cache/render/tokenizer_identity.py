"""A tokenizer's identity in the key: a stable fingerprint of everything that can change how it
renders and tokenizes, computed once per tokenizer state and re-checked on every call, so a
tokenizer changed after first use gets a new one.

The re-check (``encode_settings``) reads, at the moment the key is made, every settable part of
the tokenizer that changes its encode: the backend object, the vocabulary size with added
tokens, special tokens, ``split_special_tokens``, the added-tokens table with every token's
flags, and the backend's pipeline -- normalizer, pre-tokenizer, post-processor and decoder
(each as its serialized state: replacing one, or setting one of its fields in place, changes
it), padding, truncation, and the model (its kind, every setting it exposes, its vocabulary size
and tokens sampled across it). Nothing is watched or patched: the same reading runs with the
fast path on and off (docs/benchmarks.md, ``bench/recheck_cost.py``, for what it costs).

The one change the reading does not see in full is a model replaced by another of the same kind,
settings and vocabulary size whose tokens differ only away from the sampled ids: reading a
whole vocabulary costs ~0.4 s (Qwen3), so it is read when the fingerprint is made, not on every
call.

The memo of states is an object (``TokenizerStates``) its owner keeps: a cache, the grammar
compiler.
"""

from __future__ import annotations

import operator
import threading
import types
from collections.abc import Callable
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson
import xxhash

__all__ = ["TokenizerState", "TokenizerStates", "encode_settings", "pipeline_settings",
           "tokenizer_fingerprint"]

_VOCAB_SAMPLES = 4   # tokens of the model's vocabulary read on every call (and its last one)


def encode_settings(tokenizer: Any) -> tuple[Any, ...]:
    """What can change how an already fingerprinted tokenizer encodes, read in microseconds: its
    backend object, special tokens (template variables), ``split_special_tokens``, the
    added-tokens table with every token's flags, and the backend's pipeline
    (``pipeline_settings``, its model's vocabulary size included); a slow tokenizer's
    vocabulary size with added tokens and its added-tokens table.

    The table is what ``add_tokens`` changes even when the vocabulary size does not (a token
    already in the vocabulary made an added one, or an added token re-added with other flags).
    It is compared whole (``AddedToken`` equality covers content, special, normalized, lstrip,
    rstrip and single_word): about 0.15 us per added token (docs/benchmarks.md)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        table: Any = dict(getattr(tokenizer, "added_tokens_decoder", {}))
        pipeline: tuple[Any, ...] = (len(tokenizer),)
    else:  # (its size with added tokens is the model's and the table's)
        table = backend.get_added_tokens_decoder()
        pipeline = pipeline_settings(backend)
    return (
        backend,  # the object, not its id: the memo keeps it, so no new one takes its address
        bool(getattr(tokenizer, "split_special_tokens", False)),
        tokenizer.special_tokens_map,
        table,
        pipeline,
    )


def pipeline_settings(backend: Any) -> tuple[Any, ...]:
    """Every settable part of a ``tokenizers.Tokenizer`` that changes its encode, as values:
    the serialized state of its normalizer, pre-tokenizer, post-processor and decoder, its
    padding and truncation, and its model's kind, settings, vocabulary size and sampled tokens
    (``encode_special_tokens`` is transformers' ``split_special_tokens``, read there). Read
    flat, one C call per part where one does (the re-check runs on every request)."""
    model = backend.model
    kind = type(model)
    size = backend.get_vocab_size(with_added_tokens=False)
    token = model.id_to_token
    normalizer, pre, post, decoder = (backend.normalizer, backend.pre_tokenizer,
                                      backend.post_processor, backend.decoder)
    return (
        None if normalizer is None else normalizer.__getstate__(),
        None if pre is None else pre.__getstate__(),
        None if post is None else post.__getstate__(),
        None if decoder is None else decoder.__getstate__(),
        backend.padding,
        backend.truncation,
        kind,
        _model_settings(kind)(model),
        size,
        *[token(size * k // _VOCAB_SAMPLES) for k in range(_VOCAB_SAMPLES)],
        token(size - 1),
    )


@lru_cache(maxsize=16)
def _model_settings(kind: type) -> Callable[[Any], Any]:
    """What reads the settable fields a tokenizers model class exposes (BPE's ``dropout``,
    ``unk_token``, ``byte_fallback``...; WordPiece's ``max_input_chars_per_word``...), found on
    the class: one ``attrgetter`` call."""
    names = sorted(name for klass in kind.__mro__ for name, value in vars(klass).items()
                   if isinstance(value, types.GetSetDescriptorType) and not name.startswith("__"))
    return operator.attrgetter(*names) if names else _nothing


def _nothing(model: Any) -> tuple[()]:
    return ()


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


@dataclass(frozen=True, slots=True)
class TokenizerState:
    """What one call reads of a tokenizer, once, at the moment its key is made: the fingerprint,
    and the encode-time flag every later step of that call must use (transformers copies
    ``split_special_tokens`` to its Rust backend only on its next encode, so the backend's own
    flag may still be the old one)."""

    fingerprint: bytes
    split_special_tokens: bool


class TokenizerStates:
    """One owner's memo of tokenizer states: per tokenizer (weakly held), the settings last
    read and the state made from them; the fingerprint is made again only when a call reads
    other settings."""

    def __init__(self) -> None:
        self._memos: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], TokenizerState]] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    def state(self, tokenizer: Any) -> TokenizerState:
        """The tokenizer's state as it is now (its settings read whole on every call)."""
        settings = encode_settings(tokenizer)
        memo = self._memos.get(tokenizer)
        if memo is not None and memo[0] == settings:
            return memo[1]
        with self._lock:  # fingerprinting a large vocab takes a while: once per tokenizer state
            memo = self._memos.get(tokenizer)
            if memo is None or memo[0] != settings:
                split = settings[1]
                memo = self._memos[tokenizer] = (
                    settings, TokenizerState(tokenizer_fingerprint(tokenizer, split), split))
        return memo[1]

    def fingerprint(self, tokenizer: Any) -> bytes:
        """The tokenizer's fingerprint as it is now (``state``)."""
        return self.state(tokenizer).fingerprint

"""A tokenizer's identity is read whole at the moment its key is made (issue 48): every
settable part of a tokenizer that changes its encode -- its added tokens, special tokens and
``split_special_tokens``, and every part of its ``tokenizers`` pipeline (normalizer,
pre-tokenizer, post-processor, decoder, model, padding, truncation), replaced or set in place --
moves the re-check's reading and the fingerprint, and a request after the change gets the
uncached answer (the two-probe reference), with the fast path on and off. Nothing is patched.
Real Qwen3 tokenizers, each test its own copy."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors

from prefix_cache import StaticPrefixCache
from prefix_cache.render.tokenizer_identity import (
    TokenizerStates,
    encode_settings,
    tokenizer_fingerprint,
)
from tests.support import reference

SYSTEM = "Hello! You are the assistant. Hello again, and say Hello. Call <|deploy|> to ship."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there"}]
# A template of the tokenizer's own added tokens ([INST], [/INST]) around each message.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[INST] {{ m.role }}: {{ m.content }}[/INST]"
            "{% endfor %}{% if add_generation_prompt %} Sure:{% endif %}")


def _fresh() -> Any:
    """Mistral's v3 tokenizer (32k vocabulary, 751 added tokens, a normalizer, a Metaspace
    pre-tokenizer, a template post-processor), a copy of its own: these tests change it."""
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    return copy.deepcopy(load_offline_tokenizer("spm-v3"))


def _backend(tok: Any) -> Any:
    return tok.backend_tokenizer


def _set_eos(tok: Any) -> None:
    tok.eos_token = "[INST]" if tok.eos_token != "[INST]" else "</s>"


def _with_deploy_token(tok: Any) -> Any:
    other = copy.deepcopy(tok)
    other.add_tokens(["<|deploy|>"])
    return other.backend_tokenizer.__getstate__()


def _other_model(tok: Any) -> Any:
    """A model of the same kind and settings, one token larger."""
    from tokenizers.models import BPE

    state = json.loads(_backend(tok).model.__getstate__())
    vocab = dict(state["vocab"])
    vocab["▁deploy-now"] = len(vocab)
    return BPE(vocab, [tuple(m) for m in state["merges"]], unk_token=state["unk_token"],
               ignore_merges=state["ignore_merges"], byte_fallback=state["byte_fallback"],
               fuse_unk=state["fuse_unk"])


# Every change, through transformers and on its backend; then every settable pipeline part.
CHANGES: dict[str, Callable[[Any], Any]] = {
    "vocab word made an added token": lambda tok: tok.add_tokens(
        [AddedToken("Hello", normalized=False)]),
    "added token re-added with other flags": lambda tok: tok.add_tokens(
        [AddedToken("[INST]", lstrip=True, rstrip=True, normalized=False, special=True)]),
    "special token added": lambda tok: tok.add_special_tokens(
        {"additional_special_tokens": [" again"]}, replace_extra_special_tokens=False),
    "new token added": lambda tok: tok.add_tokens(["<|deploy|>"]),
    "backend: vocab word made an added token": lambda tok: _backend(tok).add_tokens(
        [AddedToken("Hello", normalized=False)]),
    "backend: flags changed": lambda tok: _backend(tok).add_special_tokens(
        [AddedToken("[INST]", lstrip=True, normalized=False, special=True)]),
    "backend: new token added": lambda tok: _backend(tok).add_tokens(["<|deploy|>"]),
    "backend state replaced in place": lambda tok: _backend(tok).__setstate__(
        _with_deploy_token(tok)),
    "special token attribute set": _set_eos,
    "split_special_tokens set": lambda tok: setattr(tok, "split_special_tokens", True),
    "normalizer replaced": lambda tok: setattr(_backend(tok), "normalizer",
                                               normalizers.Lowercase()),
    "normalizer removed": lambda tok: setattr(_backend(tok), "normalizer", None),
    "pre-tokenizer replaced": lambda tok: setattr(
        _backend(tok), "pre_tokenizer", pre_tokenizers.Metaspace(prepend_scheme="always")),
    "pre-tokenizer field set in place": lambda tok: setattr(
        _backend(tok).pre_tokenizer[0], "prepend_scheme", "never"),
    "post-processor replaced": lambda tok: setattr(
        _backend(tok), "post_processor", processors.ByteLevel(trim_offsets=True)),
    "decoder replaced": lambda tok: setattr(_backend(tok), "decoder", decoders.ByteLevel()),
    "model setting set in place": lambda tok: setattr(_backend(tok).model, "ignore_merges",
                                                      False),
    "model replaced": lambda tok: setattr(_backend(tok), "model", _other_model(tok)),
    "padding enabled": lambda tok: _backend(tok).enable_padding(length=512),
    "truncation enabled": lambda tok: _backend(tok).enable_truncation(16),
}


# transformers turns these off on its next encode (it tokenizes with padding and truncation
# off): the cache that reads them first gets a new key; the other then reads them off again.
UNDONE_BY_ENCODE = {"padding enabled", "truncation enabled"}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_first_use_gets_the_uncached_answer(change: str) -> None:
    """A hit, the change, then the next request, with the fast path on and off: the reading and
    the fingerprint move, the key changes, and both give what the uncached computation gives
    for the tokenizer as it is now (prompt ids and boundary: the two-probe reference)."""
    tok = _fresh()
    caches = {on: StaticPrefixCache(fast_path=on) for on in (True, False)}
    settings = encode_settings(tok)
    before = {on: cache.resolve(tok, MESSAGES, chat_template=TEMPLATE)
              for on, cache in caches.items()}
    assert all(c.resolve(tok, MESSAGES, chat_template=TEMPLATE).cache == "hit"
               for c in caches.values())
    CHANGES[change](tok)
    assert encode_settings(tok) != settings
    answers = []
    for i, (on, cache) in enumerate(caches.items()):
        after = cache.resolve(tok, MESSAGES, chat_template=TEMPLATE)
        if i == 0 or change not in UNDONE_BY_ENCODE:
            assert after.key != before[on].key and after.cache == "miss", on
        again = cache.resolve(tok, MESSAGES, chat_template=TEMPLATE)
        answers += [(after.prompt_ids, after.specprefill_system_end),
                    (again.prompt_ids, again.specprefill_system_end)]
    expected = (reference.render(tok, MESSAGES, None, None, TEMPLATE),
                reference.exact(tok, MESSAGES, template=TEMPLATE))
    assert answers == [expected] * 4
    assert TokenizerStates().fingerprint(tok) == tokenizer_fingerprint(tok)


def test_a_change_on_another_tokenizer_keeps_this_ones_state() -> None:
    tok, other = _fresh(), _fresh()
    states = TokenizerStates()
    before = states.state(tok)
    other.add_tokens(["<|deploy|>"])
    _backend(other).normalizer = normalizers.Lowercase()
    assert states.state(tok) is before


def test_nothing_patches_the_tokenizers_class() -> None:
    """The re-check reads; it wraps no method of ``tokenizers.Tokenizer``."""
    import tokenizers

    methods = {name: vars(tokenizers.Tokenizer).get(name) for name in
               ("add_tokens", "add_special_tokens", "train", "train_from_iterator",
                "__setstate__")}
    tok = _fresh()
    StaticPrefixCache().resolve(tok, MESSAGES, chat_template=TEMPLATE)
    assert {name: vars(tokenizers.Tokenizer).get(name) for name in methods} == methods
    assert all(type(m).__name__ == "method_descriptor" for m in methods.values())

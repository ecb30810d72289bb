"""The tokenizer re-check's quick path (the accelerators' tokenizer watch): every way the exactness tests change a
tokenizer after first use, and the same on its Rust backend, moves the quick reading, so the
added-tokens table is compared again and the key changes. Real Qwen3 tokenizers, each test its
own copy."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import AddedToken

from prefix_cache import StaticPrefixCache
from prefix_cache.fastpath import Accelerators
from prefix_cache.render.tokenizer_identity import (
    current_fingerprint,
    encode_settings,
    quick_settings,
    tokenizer_fingerprint,
)
from tests.support import reference
from tests.support.templates import DEFAULT_SYSTEM

FAST = Accelerators()
SYSTEM = "Hello! You are the assistant. Hello again, and say Hello. Call <|deploy|> to ship."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]


def _fresh_qwen3() -> Any:
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    return copy.deepcopy(load_offline_tokenizer("qwen3"))


def _set_eos(tok: Any) -> None:
    tok.eos_token = "<|endoftext|>" if tok.eos_token != "<|endoftext|>" else "<|im_end|>"


# Each change, as tests/test_exactness_holes.py and tests/test_exactness.py make it, then the
# same on the backend (what transformers calls, called directly), then the fields read each time.
CHANGES: dict[str, Callable[[Any], Any]] = {
    "vocab word made an added token": lambda tok: tok.add_tokens(
        [AddedToken("Hello", normalized=False)]),
    "added token re-added with other flags": lambda tok: tok.add_tokens(
        [AddedToken("<|im_start|>", lstrip=True, rstrip=True, normalized=False, special=True)]),
    "special token added": lambda tok: tok.add_special_tokens(
        {"additional_special_tokens": [" again"]}, replace_extra_special_tokens=False),
    "new token added": lambda tok: tok.add_tokens(["<|deploy|>"]),
    "backend: vocab word made an added token": lambda tok: tok.backend_tokenizer.add_tokens(
        [AddedToken("Hello", normalized=False)]),
    "backend: flags changed": lambda tok: tok.backend_tokenizer.add_special_tokens(
        [AddedToken("<|im_start|>", lstrip=True, normalized=False, special=True)]),
    "backend: new token added": lambda tok: tok.backend_tokenizer.add_tokens(["<|deploy|>"]),
    "backend state replaced in place": lambda tok: tok.backend_tokenizer.__setstate__(
        _with_deploy_token(tok)),
    "special token attribute set": _set_eos,
    "split_special_tokens set": lambda tok: setattr(tok, "split_special_tokens", True),
}


def _with_deploy_token(tok: Any) -> Any:
    other = copy.deepcopy(tok)
    other.add_tokens(["<|deploy|>"])
    return other.backend_tokenizer.__getstate__()


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_moves_the_quick_reading_and_the_fingerprint(change: str) -> None:
    tok = _fresh_qwen3()
    before = current_fingerprint(tok, fast=FAST)
    quick, settings = quick_settings(tok, FAST), encode_settings(tok)
    assert quick is not None  # a fast tokenizer: the quick path is taken from now on
    assert current_fingerprint(tok, fast=FAST) == before
    CHANGES[change](tok)
    assert encode_settings(tok) != settings  # the change is one the full re-check sees
    assert quick_settings(tok, FAST) != quick  # ... and so does the quick reading
    after = current_fingerprint(tok, fast=FAST)
    assert after != before
    assert after == tokenizer_fingerprint(tok)


@pytest.mark.parametrize("change", [c for c in CHANGES if "backend" in c])
def test_backend_changes_change_the_key(change: str) -> None:
    """As test_exactness_holes' table test, through the backend: a new key, the exact answer."""
    tok = _fresh_qwen3()
    cache = StaticPrefixCache()
    before = cache.resolve(tok, MESSAGES, chat_template=DEFAULT_SYSTEM)
    assert cache.resolve(tok, MESSAGES, chat_template=DEFAULT_SYSTEM).cache == "hit"
    CHANGES[change](tok)
    after = cache.resolve(tok, MESSAGES, chat_template=DEFAULT_SYSTEM)
    assert after.key != before.key and after.cache == "miss"
    assert after.prompt_ids == reference.render(tok, MESSAGES, None, None, DEFAULT_SYSTEM)
    assert after.specprefill_system_end == reference.exact(tok, MESSAGES,
                                                           template=DEFAULT_SYSTEM)
    assert cache.resolve(tok, MESSAGES, chat_template=DEFAULT_SYSTEM).cache == "hit"


def test_a_change_on_another_tokenizer_costs_one_full_comparison_only() -> None:
    """Another tokenizer's change moves the shared count: this one's table is compared again,
    found equal, and its fingerprint kept."""
    tok, other = _fresh_qwen3(), _fresh_qwen3()
    before = current_fingerprint(tok, fast=FAST)
    quick = quick_settings(tok, FAST)
    other.add_tokens(["<|deploy|>"])
    assert quick_settings(tok, FAST) != quick
    assert current_fingerprint(tok, fast=FAST) == before
    assert quick_settings(tok, FAST) is not None


def test_the_watched_methods_behave_as_before() -> None:
    tok = _fresh_qwen3()
    backend = tok.backend_tokenizer
    assert FAST.added_token_changes(backend) is not None  # watched
    count = FAST.added_token_changes(backend)
    assert backend.add_tokens(["<|deploy|>"]) == 1
    assert backend.add_tokens(["<|deploy|>"]) == 0
    assert FAST.added_token_changes(backend) != count
    assert "<|deploy|>" in backend.encode("ship <|deploy|> now").tokens
    restored = pickle.loads(pickle.dumps(backend))
    assert restored.to_str() == backend.to_str()
    count = FAST.added_token_changes(backend)
    with pytest.raises(TypeError):  # a failing call still raises, and still counts
        backend.add_tokens(None)
    assert FAST.added_token_changes(backend) != count

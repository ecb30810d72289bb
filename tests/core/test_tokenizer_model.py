"""One model of a tokenizer (``tokenizer_model``): the split, the renderer's straight path to
the backend and the tail pieces read the same facts, in the state the key read."""

from __future__ import annotations

from typing import Any

import pytest

from prefix_cache.cache.boundary import common_prefix_len, packed_prefix_len
from prefix_cache.fastpath import PieceMemo
from prefix_cache.render.render import get_renderer
from prefix_cache.render.split import split_rule
from prefix_cache.testing.offline_tokenizers import NAMES, load_offline_tokenizer
from prefix_cache.util.token_ids import pack_ids
from prefix_cache.render.tokenizer_model import TokenizerModel, own_encode_off
from tests.support.templates import DEFAULT_SYSTEM
from tests.support.tokenizers import fresh


def readers(tok: Any) -> tuple[Any, Any, Any]:
    """What the split, the renderer and the tail pieces made of ``tok``."""
    renderer = get_renderer(tok, DEFAULT_SYSTEM)
    rule = split_rule(renderer.tokenizer, renderer.split_special_tokens)
    return rule, renderer, PieceMemo().cuts(renderer)


@pytest.mark.parametrize("name", NAMES)
def test_every_reader_sees_one_model(name: str) -> None:
    tok = load_offline_tokenizer(name)
    rule, renderer, cuts = readers(tok)
    model = renderer.tokenizer_model
    assert model is not None and model.off is None and rule.off is None
    assert renderer.backend is model.backend is tok.backend_tokenizer
    assert (cuts is not None) == model.pieces_alone()


@pytest.mark.parametrize("where", ["class", "instance"])
def test_a_tokenizer_with_its_own_call_has_no_fast_part_anywhere(qwen3: Any, where: str) -> None:
    tok = fresh(qwen3)
    if where == "class":
        class OwnCall(type(qwen3)):  # type: ignore[misc]
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                return super().__call__(*args, **kwargs)

        tok.__class__ = OwnCall
    else:
        tok._encode_plus = tok._encode_plus  # bound on the instance: its own now
    reason = own_encode_off(tok)
    assert reason is not None and "encodes its own way" in reason
    rule, renderer, cuts = readers(tok)
    assert rule.off == reason and renderer.backend is None and cuts is None
    text = "<|im_start|>user\nhi<|im_end|>\n"
    assert renderer.tokenize_tail(text) == renderer.tokenize(text)


def test_split_special_tokens_is_read_as_the_key_read_it(qwen3: Any) -> None:
    """Set after loading: the key's state has it, so the split cannot end at a special token
    and the tail is not cut into pieces, whatever the backend's own copy says until the next
    encode."""
    plain_rule, _, plain_cuts = readers(fresh(qwen3))
    tok = fresh(qwen3)
    tok.split_special_tokens = True
    rule, renderer, cuts = readers(tok)
    assert renderer.tokenizer_model.split_special_tokens
    assert plain_cuts is not None and cuts is None
    text = "You are terse.<|im_end|>\n"
    assert list(plain_rule.candidates(text, len(text))) != list(rule.candidates(text, len(text)))
    assert not TokenizerModel(tok, True).pieces_alone() and TokenizerModel(tok, False).pieces_alone()


def first_difference(a: Any, b: Any) -> int:
    """The reference: a walk over the items."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


@pytest.mark.parametrize(("a", "b"), [
    ([], []), ([1, 2, 3], [1, 2, 3]), ([1, 2, 3], [1, 2]), ([1, 2, 3], [1, 9, 3]),
    ([5], [6]), (list(range(1000)), [*range(700), 1001, *range(701, 1000)]),
    (list(range(1000)), list(range(999))),
])
def test_one_common_prefix_length_for_ids_text_and_bytes(a: list[int], b: list[int]) -> None:
    text_a, text_b = ",".join(map(str, a)), ",".join(map(str, b))
    for x, y in ((a, b), (text_a, text_b), (text_a.encode(), text_b.encode())):
        assert common_prefix_len(x, y) == first_difference(x, y)
        assert common_prefix_len(y, x) == first_difference(x, y)
    assert packed_prefix_len(pack_ids(a), pack_ids(b)) == first_difference(a, b)

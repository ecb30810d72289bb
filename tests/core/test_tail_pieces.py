"""A hit's tail tokenized piece by piece (``fastpath.PieceMemo``): exactly the whole text's ids on every
offline tokenizer, pieces remembered per tenant, and encoded whole where a cut could move."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_cache.fastpath import PieceMemo, piece_cuts, pieces
from prefix_cache.render.render import get_renderer
from prefix_cache.testing.offline_tokenizers import NAMES, load_offline_tokenizer
from prefix_cache.render.tokenizer_model import TokenizerModel, piece_local
from tests.core.test_fast_tokenize import with_flags
from tests.support.tokenizers import fresh

ODD = ["", " ", "  ", "\n", "\n\n  ", "Hi", " Hi", "'ll", "\u0301", "e\u0301", "日本語", "🙂",
       "<|im_", "|>", "<", "[INST]", "<s>", "</s>", "1234567", "a\tb", "\r\n", "<|im_end|><|im_end|>"]


def specials(tok: Any) -> list[str]:
    return sorted(t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values())[:40]


def texts(tok: Any) -> list[str]:
    """Tails as templates make them (turns between added tokens), and odd joins."""
    marks = specials(tok)
    out = []
    for i, mark in enumerate(marks):
        other = marks[(i * 7 + 3) % len(marks)]
        for odd in ODD:
            out.append(f"{odd}{mark}user\n{odd}Fix module_{i}.py{odd}{other}\n{mark}assistant\n")
            out.append(f"{mark}{odd}{mark}{odd}")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_pieces_give_the_whole_texts_ids(name: str) -> None:
    tok = load_offline_tokenizer(name)
    renderer = get_renderer(tok, "{{ messages }}")
    memo = PieceMemo()
    for text in texts(tok):
        assert memo.tokenize(renderer, "t", text) == renderer.tokenize(text), text
        assert memo.tokenize(renderer, "t", text) == renderer.tokenize(text), text  # remembered


def test_every_offline_tokenizer_is_cut() -> None:
    """SentencePiece's "first piece" prefix (Metaspace ``prepend_scheme: first``) included:
    every piece but the first starts with an added token."""
    cut = {name for name in NAMES
           if piece_cuts(TokenizerModel(load_offline_tokenizer(name), False)) is not None}
    assert cut == set(NAMES)


def joins(marks: list[str]) -> st.SearchStrategy[list[str]]:
    """Added tokens and text in any order."""
    return st.lists(st.one_of(st.sampled_from(marks), st.text(max_size=6), st.sampled_from(ODD)),
                    max_size=12)


def assert_pieces_equal_whole(name: str, parts: list[str]) -> None:
    renderer = get_renderer(load_offline_tokenizer(name), "{{ messages }}")
    text = "".join(parts)
    assert PieceMemo().tokenize(renderer, "t", text) == renderer.tokenize(text)


@settings(max_examples=300, deadline=None)
@given(joins(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
              "<think>"]))
def test_any_join_of_tokens_and_text_on_qwen(parts: list[str]) -> None:
    assert_pieces_equal_whole("qwen3", parts)


@settings(max_examples=300, deadline=None)
@given(joins(["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"]))
def test_any_join_of_tokens_and_text_on_sentencepiece(parts: list[str]) -> None:
    """Metaspace's "first piece" prefix: pieces after the first start with an added token."""
    assert_pieces_equal_whole("spm-v7", parts)


def test_pieces_cut_before_each_added_token() -> None:
    cuts = piece_cuts(TokenizerModel(load_offline_tokenizer("qwen3"), False))
    assert cuts is not None
    assert pieces(cuts, "a<|im_start|>user\nhi<|im_end|>\n<|im_start|>") == [
        "a", "<|im_start|>user\nhi", "<|im_end|>\n", "<|im_start|>"]
    assert pieces(cuts, "<|im_start|>x") == ["<|im_start|>x"]
    assert pieces(cuts, "plain") == ["plain"] and pieces(cuts, "") == [""]


def test_pieces_are_remembered_per_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = load_offline_tokenizer("qwen3")
    renderer = get_renderer(tok, "{{ messages }}")
    encoded: list[str] = []
    inner = type(renderer).tokenize_tail
    monkeypatch.setattr(type(renderer), "tokenize_tail",
                        lambda self, text: encoded.append(text) or inner(self, text))
    memo = PieceMemo()
    turn1 = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    turn2 = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n" \
            "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    memo.tokenize(renderer, "a", turn1)
    assert encoded == ["<|im_start|>user\nhi", "<|im_end|>\n", "<|im_start|>assistant\n"]
    encoded.clear()
    assert memo.tokenize(renderer, "a", turn2) == renderer.tokenize(turn2)
    assert encoded == ["<|im_start|>assistant\nhello", "<|im_start|>user\nmore"]  # only new ones
    encoded.clear()
    memo.tokenize(renderer, "b", turn1)  # another tenant: nothing of a's is used
    assert encoded == ["<|im_start|>user\nhi", "<|im_end|>\n", "<|im_start|>assistant\n"]


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_a_token_that_looks_past_a_cut_means_no_cuts(qwen3: Any, flag: str) -> None:
    tok = with_flags(qwen3, {"<|im_end|>": {flag: True}})
    assert piece_cuts(TokenizerModel(tok, False)) is None
    renderer = get_renderer(tok, "{{ messages }}")
    text = "<|im_start|>user\nhi  <|im_end|>  \n<|im_start|>"
    assert PieceMemo().tokenize(renderer, "t", text) == renderer.tokenize(text)


def test_split_special_tokens_or_an_unknown_pre_tokenizer_means_no_cuts(qwen3: Any) -> None:
    tok = fresh(qwen3)
    tok.split_special_tokens = True  # the backend's own flag follows on its next encode only
    assert piece_cuts(TokenizerModel(tok, True)) is None
    assert PieceMemo().cuts(get_renderer(tok, "{{ messages }}")) is None
    assert piece_local({"type": "Metaspace", "prepend_scheme": "first"})
    assert piece_local({"type": "Sequence", "pretokenizers": [
        {"type": "ByteLevel"}, {"type": "Metaspace", "prepend_scheme": "always"}]})
    assert not piece_local({"type": "SomethingNew"})
    assert not piece_local({"type": "Sequence", "pretokenizers": [
        {"type": "ByteLevel"}, {"type": "SomethingNew"}]})

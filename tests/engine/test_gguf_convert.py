"""The GGUF converter against the GGUF itself: logits equal a direct numpy forward from the GGUF
tensors (read by llama.cpp's ``gguf`` package, ggml's rotary convention), the tokenizer equals
llama.cpp's, and what it cannot convert is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from .gguf_reference import GGUFLlama, rope_halves  # noqa: E402
from tests.support.paths import REPO  # noqa: E402


# float32 (the folder) against float64 (the reference) through 30 layers: rounding only. A
# wrong rotary convention or a mis-ordered row moves logits by whole units (checked below).
LOGIT_ATOL = 2e-3


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> GGUFLlama:
    pytest.importorskip("gguf", reason="llama.cpp's gguf package reads the reference tensors")
    return GGUFLlama(gguf_path)


@pytest.fixture(scope="module")
def prompt_ids(demo_chat_dir: Path) -> list[int]:
    from prefix_cache.model_folders.model_dir import load_tokenizer

    tok = load_tokenizer(demo_chat_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Name a red fruit."}],
                                   add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def mlx_logits(folder: Path, ids: list[int]) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm import load

    model = load(str(folder))[0]
    return np.array(model(mx.array(ids)[None])[0].astype(mx.float32))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


@pytest.mark.parametrize(("heads", "head_dim", "columns", "dtype"), [
    (9, 64, 576, np.float32),   # SmolLM2's Q
    (3, 64, 576, np.float32),   # its K
    (3, 64, 72, np.uint32),     # K's packed 4-bit rows (18 groups of 32 in 72 words)
    (2, 4, 3, np.float16),      # scales or biases of a toy shape
])
def test_unpermute_undoes_llama_cpp_permutation(heads: int, head_dim: int, columns: int,
                                                 dtype: Any) -> None:
    import mlx.core as mx

    from engine_adapter.gguf.llama import unpermute_rows

    rng = np.random.default_rng(heads * head_dim)
    hf = (rng.integers(0, 1 << 16, size=(heads * head_dim, columns))).astype(dtype)
    gguf = llama_cpp_permute(hf, heads)
    assert not np.array_equal(gguf, hf)
    assert np.array_equal(np.array(unpermute_rows(mx.array(gguf), heads)), hf)


def test_converted_logits_equal_a_direct_forward_from_the_gguf(
        reference: GGUFLlama, demo_chat_dir: Path, prompt_ids: list[int]) -> None:
    expected = reference.logits(prompt_ids)
    got = mlx_logits(demo_chat_dir, prompt_ids)
    assert got.shape == expected.shape == (len(prompt_ids), 49152)
    diff = np.abs(log_softmax(got.astype(np.float64)) - log_softmax(expected)).max()
    assert diff < LOGIT_ATOL, f"max |log-prob difference| {diff}"
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    # The check has teeth: the Hugging Face rotation on GGUF's permuted rows is far off.
    wrong = reference.logits(prompt_ids, rope=rope_halves(reference.base))
    assert np.abs(log_softmax(wrong) - log_softmax(expected)).max() > 1.0


def test_layer_truncated_copy_equals_the_first_layers(
        reference: GGUFLlama, demo_chat_2l_dir: Path, prompt_ids: list[int]) -> None:
    config = json.loads((demo_chat_2l_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    expected = reference.logits(prompt_ids, layers=2)
    got = mlx_logits(demo_chat_2l_dir, prompt_ids)
    diff = np.abs(log_softmax(got.astype(np.float64)) - log_softmax(expected)).max()
    assert diff < LOGIT_ATOL, f"max |log-prob difference| {diff}"


TEXTS = [
    "Hello world 12345",
    "  leading spaces\n\n\ttabs and\r\nwindows lines  ",
    "émigré naïve café 東京 🚀 Ωμέγα",
    "don't I'll we've 3.14159 1,000,000 -42 0x1F",
    "def f(x):\n    return x**2  # comment\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<|im_start|>system\nYou are a bot.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "a<|endoftext|>b <file_sep> <|im_end|>c",
    "x" * 40 + " The year 2024-12-03T07:44Z",
]


def test_tokenizer_equals_llama_cpp(gguf_path: Path, demo_chat_dir: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's tokenizer is the reference")

    from prefix_cache.model_folders.model_dir import load_tokenizer

    ours = load_tokenizer(demo_chat_dir)
    theirs = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    for text in TEXTS:
        expected = theirs.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == text


def test_special_tokens_and_config(demo_chat_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_wrapper
    from transformers import AutoTokenizer

    config = json.loads((demo_chat_dir / "config.json").read_text())
    assert (config["model_type"], config["rope_traditional"]) == ("llama", False)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    wrapper = load_wrapper(demo_chat_dir)
    assert (wrapper.bos_token, wrapper.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert 2 in wrapper.eos_token_ids
    plain = AutoTokenizer.from_pretrained(demo_chat_dir)  # the folder's own tokenizer files
    assert wrapper.encode("Hi") == plain.encode("Hi", add_special_tokens=False)


def test_quantized_keeps_the_gguf_blocks(gguf_path: Path, demo_chat_2l_dir: Path,
                                         prompt_ids: list[int], tmp_path: Path) -> None:
    from engine_adapter.gguf.convert import convert_gguf

    folder = convert_gguf(gguf_path, tmp_path / "q2", dtype="quantized", layers=2)
    quant = json.loads((folder / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4 and quant["group_size"] == 32
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}   # Q8_0 embeddings
    # The same model as the dequantized copy, up to float16 rounding (the 4-bit kernel computes
    # in its scales' dtype): every position's distribution within 1e-3 nats of it.
    got = log_softmax(mlx_logits(folder, prompt_ids).astype(np.float64))
    dense = log_softmax(mlx_logits(demo_chat_2l_dir, prompt_ids).astype(np.float64))
    kl = (np.exp(dense) * (dense - got)).sum(-1)
    assert kl.max() < 1e-3, kl.max()
    assert (got.argmax(-1) == dense.argmax(-1)).all()


def test_what_cannot_be_converted_is_refused(gguf_path: Path) -> None:
    from engine_adapter.gguf.convert import read_gguf
    from engine_adapter.gguf.llama import llama_config, llama_weights
    from engine_adapter.gguf.tokenizer import build_tokenizer

    metadata = read_gguf(gguf_path)[1]
    with pytest.raises(ValueError, match="only llama GGUFs"):
        llama_config({**metadata, "general.architecture": "qwen2"}, tied=True)
    with pytest.raises(ValueError, match="layers must be in"):
        llama_config(metadata, tied=True, layers=31)
    with pytest.raises(ValueError, match="RoPE scaling"):
        llama_config({**metadata, "llama.rope.scaling.type": "yarn"}, tied=True)
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        build_tokenizer({**metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2'"):
        build_tokenizer({**metadata, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        llama_weights({}, {"num_attention_heads": 9, "num_key_value_heads": 3}, "int8")


def test_convert_command(gguf_path: Path, tmp_path: Path) -> None:
    dest = tmp_path / "one-layer"
    done = subprocess.run([sys.executable, "-m", "engine_adapter.gguf.convert", str(gguf_path),
                           str(dest), "--layers", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(dest)
    assert {p.name for p in dest.iterdir()} == {"config.json", "model.safetensors",
                                                "tokenizer.json", "tokenizer_config.json",
                                                "chat_template.jinja"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no staging left
    missing = subprocess.run([sys.executable, "-m", "engine_adapter.gguf.convert",
                              str(tmp_path / "nope.gguf"), str(dest)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr

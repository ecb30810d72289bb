"""A Gemma 3 GGUF as an mlx-lm ``gemma3_text`` model: its config, weights, tokenizer and template.

mlx's own GGUF reader takes only Q4_0/Q4_1/Q8_0 blocks; Gemma 3's Q4_K_M file mixes Q4_K, Q5_0,
Q6_K and Q8_0, so its tensors are read and dequantized by llama.cpp's ``gguf`` package (numpy).

What llama.cpp's converter did to the Hugging Face checkpoint, undone here:
- every RMSNorm weight was shifted by +1 (ggml multiplies by the weight; Gemma's norm multiplies
  by ``1 + weight``, as mlx-lm's ``gemma3_text`` does), so 1 is subtracted back;
- Q and K rows are *not* permuted for Gemma (ggml runs its NEOX rotation, the two halves of a
  head, as Hugging Face does), so they are taken as they are.
What a GGUF does not say and llama.cpp hard-codes for this architecture (``llama-model.cpp``):
every sixth layer attends globally, the others through the sliding window, and the local layers
rotate with base 10,000. Attention is scaled by ``head_dim ** -0.5`` (``query_pre_attn_scalar``).

The tokenizer is a SentencePiece BPE without merges in the file; transformers' own GGUF
tokenizer mapping rebuilds it (its Gemma fixes included: respelled runs of spaces and merges in
file order). The file carries no chat template, so Gemma 3's published one is written in
(``GEMMA3_CHAT_TEMPLATE``): the system message goes in front of the first user turn.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

ARCH = "gemma3"
SLIDING_WINDOW_PATTERN = 6      # llama.cpp: hparams.set_swa_pattern(6) for LLM_ARCH_GEMMA3
ROPE_LOCAL_BASE = 10_000.0      # llama.cpp: rope_freq_base_train_swa for LLM_ARCH_GEMMA3
NORM_SHIFT = 1.0                # convert_hf_to_gguf.py adds it to Gemma's norm weights

# GGUF layer tensor -> mlx-lm (Hugging Face) name under ``model.layers.N``.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}

# Gemma 3's chat template as Google publishes it with the instruction-tuned checkpoints (the
# GGUF has none). A system message is prefixed to the first user turn; roles must alternate.
GEMMA3_CHAT_TEMPLATE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


class GGUFFile:
    """A GGUF read with llama.cpp's ``gguf`` package: fields as Python values, tensors
    dequantized to float32 numpy arrays (rows, columns) as ggml lays them out (out, in)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from gguf import GGUFReader
        except ImportError as exc:  # the mlx extra installs it
            raise ValueError("reading this GGUF needs llama.cpp's gguf package "
                             "(pip install gguf)") from exc
        self._reader = GGUFReader(str(path))
        self._tensors = {t.name: t for t in self._reader.tensors}

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def field(self, key: str) -> Any:
        """A scalar or string field's value, or a list for an array field."""
        if key not in self._reader.fields:
            raise ValueError(f"the GGUF has no {key!r} in its metadata")
        return self._reader.fields[key].contents()

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._tensors[name]
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)


def gemma3_config(gguf: GGUFFile, *, layers: int | None = None) -> dict[str, Any]:
    """The mlx-lm config.json of a Gemma 3 GGUF; ``layers`` keeps only the first ones."""
    arch = gguf.field("general.architecture")
    if arch != ARCH:
        raise ValueError(f"not a Gemma 3 GGUF: its architecture is {arch!r}")
    n_layers = int(gguf.field("gemma3.block_count"))
    if layers is not None and not 1 <= layers <= n_layers:
        raise ValueError(f"layers must be in [1, {n_layers}], got {layers}")
    if gguf.has("gemma3.rope.scaling.type"):
        raise ValueError("Gemma 3 GGUFs with RoPE scaling are not supported")
    head_dim = int(gguf.field("gemma3.attention.key_length"))
    if int(gguf.field("gemma3.attention.value_length")) != head_dim:
        raise ValueError("Gemma 3 with key_length != value_length is not supported")
    tied = "output.weight" not in gguf.tensor_names()
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": int(gguf.field("gemma3.embedding_length")),
        "num_hidden_layers": layers or n_layers,
        "intermediate_size": int(gguf.field("gemma3.feed_forward_length")),
        "num_attention_heads": int(gguf.field("gemma3.attention.head_count")),
        "num_key_value_heads": int(gguf.field("gemma3.attention.head_count_kv")),
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        # float32 in the file: its shortest decimal (1e-06, not 9.99999997e-07)
        "rms_norm_eps": float(f"{gguf.field('gemma3.attention.layer_norm_rms_epsilon'):.7g}"),
        "vocab_size": len(gguf.field("tokenizer.ggml.tokens")),
        "max_position_embeddings": int(gguf.field("gemma3.context_length")),
        "rope_theta": float(gguf.field("gemma3.rope.freq_base")),
        "rope_local_base_freq": ROPE_LOCAL_BASE,
        "sliding_window": int(gguf.field("gemma3.attention.sliding_window")),
        "sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "tie_word_embeddings": tied,
        "bos_token_id": int(gguf.field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": [int(gguf.field("tokenizer.ggml.eos_token_id")), _end_of_turn(gguf)],
    }


def _end_of_turn(gguf: GGUFFile) -> int:
    """``<end_of_turn>``'s id: an instruction-tuned Gemma ends its answers with it."""
    tokens = gguf.field("tokenizer.ggml.tokens")
    try:
        return tokens.index("<end_of_turn>")
    except ValueError:
        raise ValueError("the GGUF's vocabulary has no <end_of_turn>") from None


def gemma3_weights(gguf: GGUFFile, config: Mapping[str, Any],
                   dtype: str = "float32") -> Iterator[tuple[str, np.ndarray]]:
    """(mlx-lm name, float32 array) for each tensor kept, norms shifted back (module docstring)."""
    if dtype != "float32":
        raise ValueError(f"Gemma 3 GGUFs convert to float32 only, got dtype {dtype!r}")
    for name in gguf.tensor_names():
        stem, _, part = name.rpartition(".")
        if part != "weight":
            raise ValueError(f"unexpected GGUF tensor {name!r} for a Gemma 3 model")
        target = _target(stem, config["num_hidden_layers"])
        if target is None:
            continue
        value = gguf.tensor(name)
        if target.endswith(("norm", "layernorm")):
            value = value - np.float32(NORM_SHIFT)
        yield f"{target}.weight", value


def _target(stem: str, n_layers: int) -> str | None:
    """The mlx-lm name of a GGUF tensor stem; None for a layer cut off."""
    if stem in TOP_NAMES:
        return TOP_NAMES[stem]
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return (f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
                if int(parts[1]) < n_layers else None)
    raise ValueError(f"unexpected GGUF tensor {stem!r} for a Gemma 3 model")


def gemma3_tokenizer(gguf: GGUFFile) -> tuple[Any, dict[str, Any]]:
    """(``tokenizers.Tokenizer``, tokenizer_config.json) rebuilt by transformers' GGUF mapping."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    tokenizer_dict: dict[str, Any] = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        if gguf.has(f"tokenizer.{key}"):
            tokenizer_dict[name] = gguf.field(f"tokenizer.{key}")
    backend, _ = convert_gguf_tokenizer(ARCH, tokenizer_dict)
    tokens = tokenizer_dict["tokens"]

    def token(key: str) -> str | None:
        return tokens[int(gguf.field(key))] if gguf.has(key) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": "<end_of_turn>",    # what the chat model ends a turn with
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        # The chat template writes <bos> itself; tokenizing a render adds nothing.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.field("gemma3.context_length")),
    }
    return backend, config

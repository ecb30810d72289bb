"""A llama-architecture GGUF as an mlx-lm ``llama`` model: its config and its weights.

GGUF names follow ggml (``blk.3.attn_q.weight``); mlx-lm's follow Hugging Face
(``model.layers.3.self_attn.q_proj.weight``). llama.cpp's converter permutes the rows of Q and
K within each head so that ggml's rotary embedding, which turns adjacent pairs of dimensions,
computes what the Hugging Face model computes by turning the two halves of a head. We undo that
permutation here, so the folder holds the Hugging Face weights and runs with mlx-lm's default
``rope_traditional: false``, like any converted Hugging Face checkpoint (``rope_traditional:
true`` on the permuted rows computes the same numbers; un-permuting keeps the folder standard).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

# GGUF layer tensor -> mlx-lm (Hugging Face) name under ``model.layers.N``.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
# mx.load hands GGUF's 32-element blocks (Q4_0, Q4_1, Q8_0) back as MLX affine groups of 32.
GROUP_SIZE = 32
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _scalar(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"the GGUF has no {key!r} in its metadata")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def llama_config(metadata: Mapping[str, Any], *, tied: bool,
                 layers: int | None = None) -> dict[str, Any]:
    """The mlx-lm config.json of a llama GGUF; ``layers`` keeps only the first ones."""
    arch = _scalar(metadata, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUFs convert, this one is {arch!r}")
    n_layers = int(_scalar(metadata, "llama.block_count"))
    if layers is not None and not 1 <= layers <= n_layers:
        raise ValueError(f"layers must be in [1, {n_layers}], got {layers}")
    hidden = int(_scalar(metadata, "llama.embedding_length"))
    heads = int(_scalar(metadata, "llama.attention.head_count"))
    head_dim = int(metadata.get("llama.rope.dimension_count", mx.array(hidden // heads)).item())
    if head_dim * heads != hidden:
        raise ValueError(f"rotary dimension {head_dim} x {heads} heads != hidden {hidden}: "
                         "partial rotary embeddings are not supported")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers or n_layers,
        "intermediate_size": int(_scalar(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get("llama.attention.head_count_kv",
                                                mx.array(heads)).item()),
        "head_dim": head_dim,
        # float32 in the file: its shortest decimal (1e-05, not 9.9999997e-06)
        "rms_norm_eps": float(f"{_scalar(metadata, 'llama.attention.layer_norm_rms_epsilon'):.7g}"),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(_scalar(metadata, "llama.context_length")),
        "rope_theta": float(f"{metadata.get('llama.rope.freq_base', mx.array(10000.0)).item():.7g}"),
        "rope_traditional": False,  # Q and K are un-permuted (module docstring)
        "tie_word_embeddings": tied,
        "bos_token_id": int(_scalar(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(metadata, "tokenizer.ggml.eos_token_id")),
    }
    if "llama.rope.scaling.type" in metadata:
        raise ValueError("GGUFs with RoPE scaling are not supported")
    return config


def unpermute_rows(x: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's per-head row permutation of Q or K (rows interleaved in pairs back
    to two halves); works on a float matrix and on packed weights, scales and biases alike,
    since quantization groups run along each row."""
    rows = x.shape[0]
    half = rows // heads // 2
    return x.reshape(heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _bits(packed: mx.array, scales: mx.array) -> int:
    return packed.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)


def llama_weights(tensors: Mapping[str, mx.array], config: Mapping[str, Any],
                  dtype: str = "float32") -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """(mlx-lm weights, quantization config or None) from the GGUF's tensors.

    ``dtype`` "float32"/"float16"/"bfloat16" dequantizes every matrix (exactly, from float32
    scales and biases, then cast); "quantized" keeps GGUF's 4- and 8-bit blocks as mlx-lm
    quantized layers (the bits are per layer, read from the packing)."""
    if dtype != "quantized" and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join([*DTYPES, 'quantized'])}, got {dtype!r}")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    for name, value in tensors.items():
        stem, _, part = name.rpartition(".")          # part: weight, scales or biases
        target, gguf_kind = _target(stem, config["num_hidden_layers"])
        if target is None:
            continue
        if gguf_kind in heads:
            value = unpermute_rows(value, heads[gguf_kind])
        out[f"{target}.{part}"] = value
    if dtype == "quantized":
        for key in [k for k in out if k.endswith(".scales")]:
            prefix = key[: -len(".scales")]
            bits[prefix] = _bits(out[f"{prefix}.weight"], out[key])
        common = max(set(bits.values()), key=list(bits.values()).count) if bits else 4
        quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
        quant.update({p: {"group_size": GROUP_SIZE, "bits": b}
                      for p, b in bits.items() if b != common})
        return out, quant
    floats: dict[str, mx.array] = {}
    for key, value in out.items():
        if key.endswith((".scales", ".biases")):
            continue
        prefix = key[: -len(".weight")]
        if f"{prefix}.scales" in out:
            scales = out[f"{prefix}.scales"].astype(mx.float32)
            biases = out[f"{prefix}.biases"].astype(mx.float32)
            value = mx.dequantize(value, scales, biases, group_size=GROUP_SIZE,
                                  bits=_bits(value, scales))
        floats[key] = value.astype(DTYPES[dtype])
    return floats, None


def _target(stem: str, n_layers: int) -> tuple[str | None, str]:
    """The mlx-lm name of a GGUF tensor stem (None for layers cut off) and its GGUF kind."""
    if stem in TOP_NAMES:
        return TOP_NAMES[stem], stem
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        layer = int(parts[1])
        if layer >= n_layers:
            return None, parts[2]
        return f"model.layers.{layer}.{LAYER_NAMES[parts[2]]}", parts[2]
    raise ValueError(f"unexpected GGUF tensor {stem!r} for a llama model")

"""Write a tiny random-weights mlx-lm model folder with a real tokenizer and chat template.

    python -m engine_adapter.testing.tiny_model DEST [--arch ARCH] [--hidden 64] [--layers 2]
                                            [--heads 4] [--kv-heads 2] [--intermediate N]

ARCH is a plain full-attention family (qwen3, llama, qwen2) or one whose caches are not all
``KVCache`` (``FAMILIES``): gemma3_text and gpt_oss (sliding-window layers, ``RotatingKVCache``,
window ``TINY_WINDOW`` so test prompts pass it), qwen3_next and qwen3_5 (gated DeltaNet layers
with recurrent state, ``ArraysCache``, beside full-attention ones), qwen3_moe (plain KV, MoE).
With two layers each hybrid has one layer of each kind.

The folder (config.json, model.safetensors in float32, tokenizer.json, tokenizer_config.json,
chat_template.jinja) loads with ``mlx_lm.load(DEST)`` and serves with
``python -m mlx_lm.server --model DEST``, offline. The weights are random, so the text it
generates is noise; what it is for is a real engine on the other end of the sidecar in tests.
The vocabulary is the tokenizer's full one (specials included), so every id the tokenizer can
produce has an embedding row.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

from ..folder_cli import folder_parser, print_folder, read_template

ARCHES = ("qwen3", "llama", "qwen2", "qwen3_moe", "gemma3_text", "gpt_oss", "qwen3_next",
          "qwen3_5")
# The families whose mlx-lm caches go beyond plain KV, and the MoE control (plain KV).
FAMILIES = ("gemma3_text", "gpt_oss", "qwen3_next", "qwen3_5", "qwen3_moe")
TINY_WINDOW = 32          # sliding window of the tiny gemma3_text and gpt_oss models, in tokens
# (tokenizer name, template) -> (vocabulary size with specials, eos id), per process
_VOCAB: dict[tuple[str, str], tuple[int, int | None]] = {}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM",
                 "qwen3_5": "Qwen3_5ForConditionalGeneration"}
WEIGHTS_FILE = "model.safetensors"


def tiny_config(arch: str, vocab_size: int, *, hidden: int = 64, layers: int = 2,
                heads: int = 4, kv_heads: int = 2,
                intermediate: int | None = None) -> dict[str, Any]:
    """An mlx-lm config.json for ``arch`` at toy size (intermediate defaults to 2 * hidden)."""
    if arch not in ARCHES:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHES)}")
    if hidden <= 0 or layers <= 0 or heads <= 0 or kv_heads <= 0:
        raise ValueError("hidden, layers, heads and kv_heads must be positive")
    if intermediate is not None and intermediate <= 0:
        raise ValueError(f"intermediate must be positive, got {intermediate}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), "
                         f"and heads by kv_heads ({kv_heads})")
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate if intermediate is not None else hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0,
        # Tied embeddings: the 151k-row table is the bulk of the weights; one copy is enough.
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    config.update(_family_fields(arch, hidden, heads, layers, config["intermediate_size"]))
    if arch == "qwen3_5":  # a vision-language wrapper: the text model's config is nested
        config = {"model_type": arch, "text_config": {**config, "model_type": "qwen3_5_text"},
                  "tie_word_embeddings": True, "vocab_size": vocab_size,
                  "max_position_embeddings": config["max_position_embeddings"]}
    config["architectures"] = [ARCHITECTURES[arch]]
    return config


def _family_fields(arch: str, hidden: int, heads: int, layers: int,
                   intermediate: int) -> dict[str, Any]:
    """The config fields a family adds to the plain ones, at toy size: 4 experts (2 active),
    a ``TINY_WINDOW`` sliding window on every other layer, linear-attention heads."""
    head_dim = hidden // heads
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "moe_intermediate_size": intermediate // 2,
           "norm_topk_prob": True}
    # Layer i is full attention when i % interval == interval - 1: one of each with 2 layers.
    linear = {"linear_num_value_heads": 4, "linear_num_key_heads": 2,
              "linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim,
              "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
              "shared_expert_intermediate_size": intermediate, "partial_rotary_factor": 0.25}
    if arch == "qwen3_moe":
        return moe
    if arch == "gemma3_text":
        return {"sliding_window": TINY_WINDOW, "sliding_window_pattern": 2,
                "query_pre_attn_scalar": head_dim, "rope_local_base_freq": 10_000.0}
    if arch == "gpt_oss":
        return {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": TINY_WINDOW,
                "layer_types": [("sliding_attention", "full_attention")[i % 2]
                                for i in range(layers)]}
    if arch == "qwen3_next":
        return {**moe, **linear}
    if arch == "qwen3_5":
        return {**linear, "rope_parameters": {"type": "default", "rope_theta": 100_000.0,
                                              "partial_rotary_factor": 0.25,
                                              "mrope_section": [1, 1, 0]}}
    return {}


def write_weights(folder: Path, config: dict[str, Any], seed: int = 0) -> None:
    """Random float32 weights for ``config``, saved as the model's safetensors file."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = {name: value.astype(mx.float32) for name, value in flat}
    mx.save_safetensors(str(folder / WEIGHTS_FILE), weights, metadata={"format": "mlx"})


def make_tiny_model(dest: Path, arch: str = "qwen3", *, tokenizer: str = "qwen3",
                    chat_template: str | None = None, hidden: int = 64, layers: int = 2,
                    seed: int = 0, heads: int = 4, kv_heads: int = 2,
                    intermediate: int | None = None) -> Path:
    """Lay out the tiny model folder at ``dest`` and return it."""
    from prefix_cache.model_folders.demo import DEMO_TEMPLATE
    from prefix_cache.model_folders.model_dir import load_tokenizer
    from prefix_cache.testing.offline_tokenizers import make_model_dir

    dest = Path(dest)
    template = chat_template if chat_template is not None else DEMO_TEMPLATE
    make_model_dir(dest, tokenizer, template)
    key = (tokenizer, template)
    if key not in _VOCAB:  # loading the tokenizer is most of the cost of a tiny model: once
        tok = load_tokenizer(dest)
        _VOCAB[key] = (len(tok), tok.eos_token_id)
    vocab, eos = _VOCAB[key]
    config = tiny_config(arch, vocab, hidden=hidden, layers=layers, heads=heads,
                         kv_heads=kv_heads, intermediate=intermediate)  # specials included
    if eos is not None:  # mlx-lm stops generating where the template ends a turn
        config["eos_token_id"] = eos
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    write_weights(dest, config, seed)
    return dest


def tiny_model_folder(dest: Path, arch: str = "qwen3", **options: Any) -> Path:
    """``make_tiny_model`` unless ``dest`` already holds a finished one (weights are written
    last), so several test modules of one session share a folder."""
    dest = Path(dest)
    if not (dest / WEIGHTS_FILE).is_file():
        make_tiny_model(dest, arch, **options)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = folder_parser("engine_adapter.testing.tiny_model", __doc__,
                           "the demo template, which renders tools")
    parser.add_argument("dest", type=Path, help="folder to write (created or overwritten)")
    parser.add_argument("--arch", choices=ARCHES, default="qwen3")
    parser.add_argument("--tokenizer", default="qwen3",
                        help="offline tokenizer name (prefix_cache.testing.offline_tokenizers.NAMES)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--intermediate", type=int, default=None,
                        help="MLP width (default: 2 * hidden)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return print_folder("tiny_model", lambda: make_tiny_model(
        args.dest, args.arch, tokenizer=args.tokenizer,
        chat_template=read_template(args.chat_template), hidden=args.hidden,
        layers=args.layers, seed=args.seed, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate), errors=(ValueError, KeyError))


if __name__ == "__main__":
    sys.exit(main())

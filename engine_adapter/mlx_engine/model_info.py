"""What a loaded mlx-lm model's config says about it: vocabulary size and context window."""

from __future__ import annotations

from typing import Any

# RoPE scalings whose factor stretches ``max_position_embeddings`` (Qwen's YaRN recipe leaves
# that field at the trained length); llama3 and longrope configs already state the full window.
_STRETCHING_ROPE = {"yarn", "linear", "dynamic"}


def vocab_size(model: Any) -> int | None:
    """The model's vocabulary size when its config says it."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def context_length(model: Any) -> int | None:
    """The model's context window when its config says it: ``max_position_embeddings``, times
    the RoPE scaling factor for scalings that extend it (as vLLM reads it)."""
    args = getattr(model, "args", None)
    size = getattr(args, "max_position_embeddings", None)
    if not isinstance(size, int) or size <= 0:
        return None
    scaling = getattr(args, "rope_scaling", None)
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        factor = scaling.get("factor")
        if kind in _STRETCHING_ROPE and isinstance(factor, (int, float)) and factor > 1:
            size = int(size * factor)
    return size

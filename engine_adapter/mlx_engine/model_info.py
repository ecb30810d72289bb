"""What a loaded mlx-lm model's config says about it: vocabulary size and context window."""

from __future__ import annotations

from typing import Any

# RoPE scalings whose factor stretches ``max_position_embeddings`` (Qwen's YaRN recipe leaves
# that field at the trained length); llama3 and longrope configs already state the full window.
_STRETCHING_ROPE = {"yarn", "linear", "dynamic"}


def _config(model: Any, name: str) -> Any:
    """A config field, or the text model's (vision-language wrappers such as Qwen3.5 nest it
    in ``text_config``)."""
    args = getattr(model, "args", None)
    value = getattr(args, name, None)
    text = getattr(args, "text_config", None)
    if value is None and isinstance(text, dict):
        value = text.get(name)
    return value


def vocab_size(model: Any) -> int | None:
    """The model's vocabulary size when its config says it."""
    size = _config(model, "vocab_size")
    return int(size) if isinstance(size, int) else None


def context_length(model: Any) -> int | None:
    """The model's context window when its config says it: ``max_position_embeddings``, times
    the RoPE scaling factor for scalings that extend it (as vLLM reads it)."""
    size = _config(model, "max_position_embeddings")
    if not isinstance(size, int) or size <= 0:
        return None
    scaling = _config(model, "rope_scaling")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        factor = scaling.get("factor")
        if kind in _STRETCHING_ROPE and isinstance(factor, (int, float)) and factor > 1:
            size = int(size * factor)
    return size

"""What the engine takes from mlx-lm: the batch API of the releases it is tested with, and what
a loaded model's config says about it (vocabulary size, context window)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

# pyproject's mlx-lm range: the releases the engine is tested with (BatchGenerator's keywords,
# StopSequences and the cache classes changed names across releases before it).
MLX_LM_RANGE = ">=0.32.2,<0.33"


def needs_mlx_lm(missing: str) -> str:
    """The message for an mlx-lm whose batch API lacks what the engine calls."""
    try:
        installed = f"mlx-lm {version('mlx-lm')} is installed"
    except PackageNotFoundError:
        installed = "mlx-lm is not installed"
    return (f"the MLX engine needs mlx-lm{MLX_LM_RANGE} ({missing}); {installed}: "
            f"pip install 'mlx-lm{MLX_LM_RANGE}'")


try:  # the one import of mlx-lm's batch API: a release without these names says what it needs
    from mlx_lm.generate import BatchGenerator, StopSequences
except ImportError as exc:
    raise ImportError(needs_mlx_lm(f"mlx_lm.generate lacks: {exc}")) from exc

__all__ = ["BatchGenerator", "StopSequences", "context_length", "needs_mlx_lm", "vocab_size"]

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

"""The in-process MLX engine: continuous batching on mlx-lm, static-prefix KV reuse, SpecPrefill.

Importing this package imports mlx; ``import engine_adapter`` alone does not.
"""

from .engine import MLXEngine
from .kv_store import KVSnapshotStore
from .request import CheckedRequest, EngineError, GenerationRequest, PrefillInfo, TokenEvent
from .specprefill import SpecPrefillConfig

__all__ = [
    "CheckedRequest",
    "EngineError",
    "GenerationRequest",
    "MLXEngine",
    "PrefillInfo",
    "SpecPrefillConfig",
    "KVSnapshotStore",
    "TokenEvent",
]

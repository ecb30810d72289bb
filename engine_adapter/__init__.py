"""Downstream engines that use the static-prefix boundary.

- ``engine_adapter.mlx_engine``: the in-process batched MLX engine (imports mlx).
- ``engine_adapter.backend``: that engine as a ``prefix_cache.engine.protocol.ChatBackend``
  (token ids in, text deltas out); ``engine_adapter.registry``: engines by name for
  ``--engine``; ``engine_adapter.server``: ``prefix-cache serve-engine``.
- ``engine_adapter.plugin``: routes an engine's own ``specprefill_system_end`` computation
  through ``StaticPrefixCache`` (no mlx).
- ``engine_adapter.testing.tiny_model``: tiny random-weights model folders for tests and demos.

Nothing here is imported eagerly: ``import engine_adapter`` stays cheap and mlx-free, and names
resolve on first use (``engine_adapter.MLXEngine`` imports mlx then).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "MLXBackend": "engine_adapter.backend",
    "MLXEngine": "engine_adapter.mlx_engine",
    "GenerationRequest": "engine_adapter.mlx_engine",
    "SpecPrefillConfig": "engine_adapter.mlx_engine",
    "KVSnapshotStore": "engine_adapter.mlx_engine.kv_store",
    "SpecPrefillBoundary": "engine_adapter.plugin",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_adapter' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

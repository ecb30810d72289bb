"""Downstream engines that use the static-prefix boundary.

- ``mlx_engine/``: the in-process batched MLX engine (imports mlx).
- ``backend.py``: that engine as a ``prefix_cache.engine.protocol.ChatBackend`` (token ids in,
  text deltas out), with ``decoding.py`` (incremental decoding, stop strings), ``tool_calls.py``
  (tool calls cut out of the text), ``families.py`` (each family's call format, and the
  registry of families the tests round-trip), ``call_parsers.py`` (Llama 3.x and DeepSeek
  calls), ``call_stream.py`` (tool calls streamed as written) and
  ``reasoning.py`` (a ``<think>`` family's reasoning apart from the answer); ``grammar/``:
  constrained decoding.
- ``registry.py``: engines by name for ``--engine``; ``options.py`` and ``defaults.py``: their
  options and defaults; ``purge_marks.py``: each namespace's last purge, on one clock, so
  what a request issued before a purge computes (KV, a compiled grammar) is not kept after it;
  ``server.py``: ``prefix-cache serve-engine``, with ``engine_host.py``
  (the engine server as the API layer's host).
- ``plugin.py``: routes an engine's own ``specprefill_system_end`` computation through
  ``StaticPrefixCache`` (no mlx); ``omlx_hooks.py``: where ``install`` hooks it into each oMLX
  engine shape; ``omlx_tenant.py``: oMLX's API key as the tenant.
- ``demo_model.py``: the demo chat model folder, converted from a GGUF (``gguf/``);
  ``gemma_model.py``: Gemma 3 270M's folder (real sliding-window weights), likewise;
  ``folder_cli.py``: the end of a command that writes a model folder.
- ``testing/``: tiny random-weights model folders and reference computations for tests.

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
    "KVSnapshotStore": "engine_adapter.mlx_engine.kv.store",
    "SpecPrefillBoundary": "engine_adapter.plugin",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_adapter' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

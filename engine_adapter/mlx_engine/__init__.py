"""The in-process MLX engine: continuous batching on mlx-lm, static-prefix KV reuse, SpecPrefill.

Importing this package imports mlx; ``import engine_adapter`` alone does not.

The loop and public API (``engine.py``), one request and its events (``request.py``), a running
sequence (``sequence.py``) and the delivery of its tokens to their reader (``delivery.py``); KV
reuse policy: static prefixes, conversations, parking (``reuse.py``) and a finished sequence's
prompt and reply kept for the next turn (``reply.py``); prefill, dense and sparse, and a dense
prompt in budgeted chunks (``prefill.py``), each step's token budget shared across namespaces
(``budget.py``), SpecPrefill jobs (``specprefill_jobs.py``) and their scoring and chunk choice
(``specprefill.py``), a layer-truncated draft's layers reused by the target
(``draft_layers.py``); the sampler with each sequence's grammar mask (``sampling.py``), speculative decoding from
each sequence's own tokens, verified in the batch's decode forward (``speculative.py``),
``rope.py``, mlx-lm's batch API and a config's vocabulary and window (``model_info.py``), mlx's
device streams ended cleanly (``mlx_streams.py``). The KV itself, its snapshots, stores and disk
tier: ``kv/``.
"""

from .engine import MLXEngine
from .kv.store import KVSnapshotStore
from .request import EngineError, GenerationRequest, PrefillInfo, TokenEvent
from .specprefill import SpecPrefillConfig

__all__ = [
    "EngineError",
    "GenerationRequest",
    "MLXEngine",
    "PrefillInfo",
    "SpecPrefillConfig",
    "KVSnapshotStore",
    "TokenEvent",
]

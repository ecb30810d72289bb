"""The in-process MLX engine: continuous batching on mlx-lm, static-prefix KV reuse, SpecPrefill.

Importing this package imports mlx; ``import engine_adapter`` alone does not.

The loop and public API (``engine.py``), one request and its events (``request.py``), a running
sequence (``sequence.py``) and the delivery of its tokens (``delivery.py``); KV reuse policy:
static prefixes, conversations, parking (``reuse.py``) and a finished sequence's prompt and reply
kept for the next turn (``reply.py``); prefill, dense and sparse, and a dense prompt in
budgeted chunks (``prefill.py``), each step's token budget shared across namespaces
(``budget.py``), SpecPrefill jobs (``sparse.py``) and their scoring and chunk choice
(``specprefill.py``), a layer-truncated draft's layers reused by the target (``draft_layers.py``);
the sampler with each sequence's grammar mask (``sampling.py``), ``rope.py``, mlx-lm's batch API
and a config's vocabulary and window (``model_info.py``), mlx streams ended cleanly
(``streams.py``). KV: per-sequence KV and snapshots (``kv_cache.py``), snapshots of
sliding-window and recurrent layers (``layered.py``), the RAM stores and the radix index
(``kv_store.py``), a RAM store over the disk tier (``kv_tiered.py``), and the disk tier itself
(``kv_disk.py``) with its files (``kv_file.py``), folder (``kv_folder.py``), keys
(``kv_disk_keys.py``), start-up scan (``kv_disk_scan.py``), setup (``kv_disk_setup.py``) and the
model fingerprint (``kv_fingerprint.py``).
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

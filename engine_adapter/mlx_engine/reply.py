"""A finished sequence's KV, prompt and reply, kept in the conversation store: an agent's next
turn holds the model's own reply, so it restores that KV instead of computing it again (as
mlx_lm.server's prompt cache does).

The entry's ids are the prompt followed by every generated token (BatchGenerator has run the
last one through the model when it reports the finish, so the cache holds all of them). A next
prompt restores the longest prefix it shares with those ids: up to where its re-rendered reply
diverges from what was generated (a template that strips thinking or reformats a tool call),
never more. After a SpecPrefill the entry is the sparse history plus the dense reply, at their
positions. Only a sequence that finished (stop or length) gets here: a cancelled or failed one
keeps no more than the prompt it computed.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

from .kv import cache as kv_cache
from .kv.store import KVSnapshotStore
from .request import GenerationRequest


class FinishedSequence(Protocol):
    """What this module reads of a finished ``sequence.EngineSequence`` (a protocol, so that
    ``reuse`` -> ``reply`` -> ``sequence`` -> ``reuse`` is no import circle)."""

    request: GenerationRequest
    plan: Any        # reuse.ReusePlan: restored, restored_positions, keep_pct
    generated: list[int]

log = logging.getLogger("engine_adapter.mlx_engine")


def reply_tokens(snapshot: Any, n: int) -> int:
    """Of the first ``n`` tokens restored from ``snapshot``: those an earlier request generated."""
    start = snapshot.reply_from
    return 0 if start is None else max(0, n - start)


def store_reply(store: KVSnapshotStore, model_id: str, seq: FinishedSequence,
                cache: Any) -> bool:
    """Store the prompt's and the generated tokens' KV of a finished ``seq`` from its final
    per-sequence ``cache``; False when it is not kept (a failure costs a later reuse only)."""
    req, plan = seq.request, seq.plan
    prompt = list(req.prompt_ids)
    ids = prompt + seq.generated
    n = len(ids)
    positions = plan.restored_positions
    if positions is not None:      # sparse: what was restored or kept, then all the rest
        positions = positions + tuple(range(plan.restored, n))
    stored = n if positions is None else len(positions)
    try:
        if cache is None or kv_cache.cache_size(cache) != stored:
            # A SpecPrefill whose KV is not kept for reuse (its positions are not known here).
            return False
        snap = (kv_cache.snapshot(cache, n) if positions is None
                else kv_cache.snapshot(cache, stored, positions=positions, span=n,
                                       keep_pct=plan.keep_pct))
        snap = replace(snap, reply_from=len(prompt))
        # A trimmable entry serves any prefix of its ids, so it supersedes the prompt's entry;
        # a layered one restores only whole, and the prompt's stays for a reply sent back
        # changed.
        return store.put(req.namespace, model_id, ids, snap, supersede=snap.trimmable,
                         issued=req.issued)
    except Exception:
        log.warning("could not store the reply KV of %s", req.request_id, exc_info=True)
        return False

"""SpecPrefill jobs: a request's sparse prefill, one model chunk per engine step, between the
decode steps of the running batch.

    protected part   the static prefix (restored or computed, and stored), or the longer
                     prefix an earlier prompt of the conversation restores
    draft            reads the prompt from its static prefix on, scores what follows the
                     protected part (``score_steps``)
    target           prefills the kept chunks at their own positions; the job's result is the
                     cache the engine inserts with the last prompt token

On models with sliding-window or recurrent layers (opt-in, ``SpecPrefillConfig.hybrid``) every
layer sees only the kept tokens, the last window of tokens always among them; the static
prefix is still exact (restored or computed densely, and stored).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .kv import cache as kv_cache
from .draft_layers import layered_sparse_prefill_steps
from .kv.layered import max_window
from .model_info import vocab_size
from .prefill import sparse_prefill_steps
from .reuse import DRAFT_ID, TARGET_ID, ConversationHit, KVReuse
from .specprefill import SpecPrefillConfig, score_steps, select_chunks

if TYPE_CHECKING:
    from .sequence import EngineSequence


@dataclass(frozen=True, slots=True)
class SparsePrefill:
    """A finished SpecPrefill: the target's cache, rotated so the last prompt token lands at
    its own position, and what it holds."""

    cache: list[Any]
    protected: int                                   # prompt tokens kept whole
    protected_positions: tuple[int, ...] | None      # their stored positions (None: all)
    kept: tuple[int, ...]                            # positions prefilled after them
    reused: int                                      # of ``protected``: restored, not computed
    from_conversation: bool                          # restored from an earlier prompt
    reply: int = 0                                   # of ``reused``: generated earlier


@dataclass(slots=True)
class SparseJob:
    """A SpecPrefill in progress for one sequence."""

    seq: EngineSequence
    ids: list[int]
    static: int
    steps: Generator[None, None, SparsePrefill]
    chunk: int = 0                  # tokens per step: what a step's budget is charged

    @property
    def request_id(self) -> str:
        return self.seq.request.request_id

    @property
    def namespace(self) -> str:
        return self.seq.request.namespace

    @property
    def left(self) -> int:          # an estimate: the draft reads, the target keeps a share
        return len(self.ids) - self.static


def sparse_capable(reuse: KVReuse, config: SpecPrefillConfig) -> bool:
    """Whether SpecPrefill may run on the model: full attention only, or with sliding-window
    and recurrent layers too when ``config.hybrid`` opts in."""
    return reuse.positioned or (config.hybrid and reuse.reusable)


def specprefill_steps(reuse: KVReuse, target: Any, draft: Any, config: SpecPrefillConfig, *,
                      namespace: str, ids: list[int], static: int,
                      conv: ConversationHit | None, keep_pct: float | None,
                      step: int, shared_layers: int = 0,
                      issued: int | None = None) -> Generator[None, None, SparsePrefill]:
    """SpecPrefill of one prompt, a model chunk per step (see the module docstring).
    ``shared_layers``: the draft is the target's first that many layers (``draft_layers``):
    the target reuses what the draft computed instead of running those layers."""
    draft_vocab = vocab_size(draft)
    if draft_vocab is not None and max(ids) >= draft_vocab:
        raise ValueError(f"token id {max(ids)} is outside the draft's vocabulary "
                         f"({draft_vocab})")
    n = len(ids)
    protected_positions: tuple[int, ...] | None = None
    if conv is not None:       # a copy: the sparse prefill writes after it
        protected = reused = conv.tokens
        cache = kv_cache.restore(conv.snapshot, protected)
        protected_positions = conv.snapshot.positions_before(protected)
    else:
        protected = static
        cache, reused = yield from reuse.static_cache_steps(target, TARGET_ID, namespace, ids,
                                                            static, step, issued=issued)
    # The draft has no conversation KV: it reads the prompt from its static prefix on (a
    # twentieth of the target's cost) and scores only what follows the protected part.
    draft_cache, _ = yield from reuse.static_cache_steps(draft, DRAFT_ID, namespace, ids,
                                                         static, step, issued=issued)
    hidden: list[mx.array] | None = [] if shared_layers else None
    hidden_start = kv_cache.cache_size(draft_cache)
    importance = yield from score_steps(draft, ids, protected, draft_cache,
                                        lookahead=config.lookahead,
                                        pool_kernel=config.pool_kernel, step=step,
                                        hidden=hidden)
    # A sliding-window layer reads only its last window: with those tokens all kept, it holds
    # what a dense window holds (``kv_cache.rotate_ahead``). Recurrent layers get the kept ones.
    tail = config.tail_tokens if reuse.positioned else max(config.tail_tokens,
                                                           max_window(cache) + 1)
    kept = select_chunks(importance, keep_pct or config.keep_pct, config.chunk_size, tail)
    # The final prompt token is generation's first input: BatchGenerator feeds it.
    positions = tuple(protected + i for i in kept if protected + i != n - 1)
    if hidden:
        states = mx.concatenate(hidden, axis=1)
        del hidden
        yield from layered_sparse_prefill_steps(target, shared_layers, draft_cache, states,
                                                hidden_start, positions, cache, step)
    else:
        yield from sparse_prefill_steps(target, ids, positions, cache, step)
    del draft_cache
    if reuse.positioned:
        shift = (n - 1) - kv_cache.cache_size(cache)
        for layer in cache:
            layer.position_shift = shift
    else:
        cache = kv_cache.rotate_ahead(cache, n - 1)
    return SparsePrefill(cache, protected, protected_positions, positions, reused,
                         conv is not None, conv.reply if conv is not None else 0)

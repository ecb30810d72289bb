"""What an operator can set on an MLX engine, from flags, the environment or a models file.

    prefix-cache serve --engine mlx --model DIR --engine-option kv_bytes=8GiB
    prefix-cache serve-engine --model DIR --engine-option conversation_bytes=16GiB
    prefix-cache serve-engine --model DIR --engine-option kv_disk_bytes=64GiB \
        --engine-option kv_disk_dir=/ssd/kv          (the KV disk tier; kv_disk_bytes=0: off)
    PREFIX_CACHE_ENGINE_OPTIONS='{"max_context": 32768}'      (serve, every in-process engine)
    models.yaml:  qwen3-8b: {folder: ..., engine: mlx, engine_options: {kv_bytes: 8GiB}}

The KV stores' defaults (1 GiB each) suit small models; a real one needs more: Qwen3-8B's KV is
~144 KiB per token (36 layers x 8 KV heads x 128 dims x K,V x 2 bytes), so a 10k-token tools block alone takes ~1.4 GiB and a store smaller than
one entry rejects it (counted as ``rejected``). Sizes take units (``512MiB``, ``8GiB``, ``2GB``)
or plain bytes. No mlx import here: the sidecar checks options before it loads an engine.

Every engine default lives in ``engine_adapter.defaults``, the knobs an operator cannot set
included; the engine's modules and these options take theirs from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, model_validator

from prefix_cache.errors import validation_problems

from .defaults import (
    DEFAULT_KEEP_PCT,
    DEFAULT_KV_BYTES,
    DEFAULT_KV_DISK_BYTES,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SPECPREFILL_THRESHOLD,
    DEFAULT_SPECULATIVE,
    DEFAULT_STEP_TOKENS,
)


class EngineOptions(BaseModel):
    """Engine knobs; everything else keeps ``MLXEngine``'s defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_bytes: ByteSize = Field(default=ByteSize(DEFAULT_KV_BYTES), ge=0,
                               description="static-prefix KV store; 0 turns its reuse off")
    conversation_bytes: ByteSize = Field(default=ByteSize(DEFAULT_KV_BYTES), ge=0,
                                         description="conversation store; 0 turns it off")
    kv_disk_dir: str | None = Field(default=None, min_length=1, description="folder of the "
                                    "disk tier (a subfolder per model); default: engine-kv "
                                    "under the cache folder")
    kv_disk_bytes: ByteSize = Field(default=ByteSize(DEFAULT_KV_DISK_BYTES), ge=0,
                                    description="disk tier under both KV stores; 0 turns it "
                                    "off")
    reuse_sparse_kv: bool = Field(default=True, description="SpecPrefilled prompts go to the "
                                  "conversation store too (their kept tokens)")
    reuse_reply_kv: bool = Field(default=True, description="finished requests' generated "
                                 "tokens go to the conversation store too (a reply sent back)")
    max_context: int | None = Field(default=None, ge=2, description="lower the model's context "
                                    "window (prompt + max_tokens) to bound KV memory")
    default_max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1,
                                    description="tokens generated for a request that names no "
                                    "limit (cut to the context left), as mlx_lm.server's "
                                    "--max-tokens")
    max_batch_size: int = Field(default=DEFAULT_MAX_BATCH_SIZE, ge=1, le=4096,
                                description="sequences decoded together")
    specprefill_keep_pct: float = Field(default=DEFAULT_KEEP_PCT, gt=0.0, le=1.0,
                                        description="share of the scored tokens kept")
    reuse_draft_layers: bool = Field(default=False, description="the draft is the target's "
                                     "first layers (a layer-truncated copy): the target reuses "
                                     "the draft's work for them")
    specprefill_hybrid: bool = Field(default=False, description="SpecPrefill on models with "
                                     "sliding-window or recurrent layers too (approximate "
                                     "there: on Gemma 3 270M's real weights the first token's "
                                     "KL to dense is 0.27-0.79 nats, several times a plain "
                                     "model's, docs/engine.md; the static prefix stays exact)")
    fair_prefill: bool = Field(default=True, description="each engine step has a token "
                               "budget (step_tokens): decode first, then prefill chunks, "
                               "shared equally by the namespaces with prompts waiting; off: "
                               "first come first served")
    step_tokens: int = Field(default=DEFAULT_STEP_TOKENS, ge=2, le=1 << 20,
                             description="an engine step's token budget (decode tokens and "
                             "prefill chunks; more than max_batch_size): smaller keeps first "
                             "and next tokens quicker under long prompts, larger prefills "
                             "faster")
    speculative: bool = Field(default=DEFAULT_SPECULATIVE, description="speculative "
                              "decoding: drafts looked up in each sequence's own tokens "
                              "(prompt lookup), verified in the batch's decode step, backing "
                              "off where they are rejected; the same tokens either way")
    specprefill_threshold: int = Field(default=DEFAULT_SPECPREFILL_THRESHOLD, ge=0,
                                       description="SpecPrefill engages "
                                       "above this many tokens left to compute")

    @model_validator(mode="after")
    def _step_holds_the_batch(self) -> EngineOptions:
        # One token per decoding sequence comes first: a budget the batch fills leaves none
        # for prefill.
        if self.fair_prefill and self.step_tokens <= self.max_batch_size:
            raise ValueError(f"step_tokens ({self.step_tokens}) must be more than "
                             f"max_batch_size ({self.max_batch_size})")
        return self

    @classmethod
    def parse(cls, values: Mapping[str, Any] | None) -> EngineOptions:
        """Options from a mapping; ValueError naming each bad key."""
        try:
            return cls.model_validate(dict(values or {}))
        except ValidationError as exc:
            problems = validation_problems(exc, "engine options")
            raise ValueError(f"invalid engine options: {problems} (known: "
                             f"{', '.join(cls.model_fields)})") from None

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``MLXEngine`` (and so ``MLXEngine.load``); imports mlx."""
        from .mlx_engine import SpecPrefillConfig
        from .mlx_engine.kv.store import KVSnapshotStore

        kwargs: dict[str, Any] = {
            "reuse_static_kv": self.kv_bytes > 0,
            "reuse_conversation_kv": self.conversation_bytes > 0,
            "reuse_sparse_kv": self.reuse_sparse_kv,
            "reuse_reply_kv": self.reuse_reply_kv,
            "max_context": self.max_context,
            "default_max_tokens": self.default_max_tokens,  # the backend's (MLXBackend.load)
            "max_batch_size": self.max_batch_size,
            "fair_prefill": self.fair_prefill,
            "step_tokens": self.step_tokens,
            "speculative": self.speculative,
            # Read by ``MLXEngine.load``, which knows the model folders the KV comes from.
            "kv_disk_dir": self.kv_disk_dir,
            "kv_disk_bytes": (int(self.kv_disk_bytes)
                              if self.kv_bytes > 0 or self.conversation_bytes > 0 else 0),
            "specprefill": SpecPrefillConfig(keep_pct=self.specprefill_keep_pct,
                                             threshold=self.specprefill_threshold,
                                             reuse_draft_layers=self.reuse_draft_layers,
                                             hybrid=self.specprefill_hybrid),
        }
        if self.kv_bytes > 0:
            kwargs["kv_store"] = KVSnapshotStore(int(self.kv_bytes))
        if self.conversation_bytes > 0:
            kwargs["conversation_store"] = KVSnapshotStore(int(self.conversation_bytes))
        return kwargs


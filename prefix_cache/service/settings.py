"""The sidecar's settings: one model, fed by ``prefix-cache serve`` flags and the environment.

Flags win over environment variables, which win over the defaults. Every field is read from
``PREFIX_CACHE_<FIELD>`` (upper case); lists and mappings are JSON, and lists also accept a
plain comma-separated value (model folders: separated by ``os.pathsep``).

=========================  ===================  ================================================
field (env PREFIX_CACHE_)  flag                 meaning
=========================  ===================  ================================================
HOST                       --host               bind address (127.0.0.1)
PORT                       --port               TCP port (8000; 0 picks a free one)
WORKERS                    --workers            uvicorn worker processes (1)
MODEL_DIRS                 --model DIR...       model folders; a model's name is its folder's
MODELS_FILE                --models FILE        YAML/JSON: name -> {folder, template, upstream,
                                                upstream_kind, upstream_model, engine, ...}
UPSTREAM                   --upstream URL       OpenAI base URL for models that name none
UPSTREAM_KIND                                   openai (body unchanged) | specprefill (adds
                                                specprefill_system_end, prompt_token_ids,
                                                specprefill_namespace)
UPSTREAM_MODEL                                  model name sent upstream (default: unchanged)
UPSTREAM_API_KEY                                bearer key the sidecar sends upstream
ENGINE                     --engine mlx         completions on the in-process MLX engine
DRAFT_MODEL                --draft-model DIR    SpecPrefill draft model of that engine
ENGINE_OPTIONS             --engine-option K=V  JSON {kv_bytes, conversation_bytes, max_context,
                                                ...} for in-process engines (the flag
                                                repeats; engine_adapter.options lists them)
REDIS                      --redis URL          shared store; default: in-process memory
KEYS_FILE                                       YAML/JSON {tenants: {KEY: tenant}, admin_keys: [..]}
API_KEYS                                        JSON {KEY: tenant}; none anywhere: open service,
                                                everything in namespace "default"
ADMIN_KEYS                                      JSON list (or comma-separated) of admin keys
MAX_BODY_BYTES                                  request body limit, larger gets 413 (8 MiB)
TENANT_MAX_ENTRIES                              cache entries one tenant may hold (4096)
TENANT_MAX_BYTES                                bytes one tenant's entries may take (64 MiB)
UPSTREAM_TIMEOUT_S                              longest wait for the next upstream byte (600)
UPSTREAM_CONNECT_TIMEOUT_S                      upstream connect timeout (10)
READY_TIMEOUT_S                                 per-check timeout of GET /readyz (2)
METRICS_MAX_TENANTS                             tenants with their own metrics label (20); the
                                                rest are folded into "other"
LOG_LEVEL                                       uvicorn log level (info)
=========================  ===================  ================================================
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "PREFIX_CACHE_"
UpstreamKind = Literal["openai", "specprefill"]


def _split_list(value: Any, sep: str) -> Any:
    """A JSON list, or a plain ``sep``-separated string, from the environment."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)
    return [part.strip() for part in text.split(sep) if part.strip()]


def parse_key_values(items: Any, flag: str = "--engine-option") -> Any:
    """``["kv_bytes=8GiB", ...]`` (a repeated ``KEY=VALUE`` flag) as a mapping; other values
    (a mapping from JSON) pass through."""
    if not isinstance(items, (list, tuple)):
        return items
    values: dict[str, str] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        values[key.strip()] = value.strip()
    return values


class ServiceSettings(BaseSettings):
    """Everything ``prefix-cache serve`` can be told; see the module docstring for the table."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    workers: int = Field(default=1, ge=1, le=256)
    model_dirs: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    models_file: Path | None = None
    upstream: str | None = None
    upstream_kind: UpstreamKind = "openai"
    upstream_model: str | None = None
    upstream_api_key: str | None = None
    engine: str | None = None
    draft_model: Path | None = None
    engine_options: dict[str, Any] = Field(default_factory=dict)
    redis: str | None = None
    keys_file: Path | None = None
    api_keys: dict[str, str] = Field(default_factory=dict)
    admin_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_body_bytes: int = Field(default=8 << 20, gt=0)
    tenant_max_entries: int = Field(default=4096, gt=0)
    tenant_max_bytes: int = Field(default=64 << 20, gt=0)
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    upstream_connect_timeout_s: float = Field(default=10.0, gt=0)
    ready_timeout_s: float = Field(default=2.0, gt=0)
    metrics_max_tenants: int = Field(default=20, gt=0)
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"

    @field_validator("model_dirs", mode="before")
    @classmethod
    def _model_dirs(cls, value: Any) -> Any:
        return _split_list(value, os.pathsep)

    @field_validator("engine_options", mode="before")
    @classmethod
    def _engine_options(cls, value: Any) -> Any:
        return parse_key_values(value)

    @field_validator("admin_keys", mode="before")
    @classmethod
    def _admin_keys(cls, value: Any) -> Any:
        return _split_list(value, ",")

    @field_validator("upstream", "redis", "upstream_model", "upstream_api_key", "engine")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        # An exported-but-empty variable (PREFIX_CACHE_REDIS=) means "not set", not "".
        return value or None

    @property
    def uses_memory_store(self) -> bool:
        """True when hits live in each worker's own memory (no shared store)."""
        return not self.redis or self.redis.startswith("memory")

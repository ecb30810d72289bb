"""The sidecar's settings: one model, the single source of ``prefix-cache serve``'s flags and
environment variables.

Flags win over environment variables, which win over the defaults. Every field is read from
exactly one variable, ``PREFIX_CACHE_<FIELD>`` (upper case): ``redis_url`` from
``PREFIX_CACHE_REDIS_URL``, ``models_file`` from ``PREFIX_CACHE_MODELS_FILE`` ... Lists and
mappings are JSON; lists also take a plain comma-separated value (model folders: separated by
``os.pathsep``). A field with a ``flag`` is also a command-line flag (``flags`` generates them
from here, help included); ``prefix-cache serve --help`` lists every field, flag and variable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..cache.prompt_tokens import DEFAULT_CHECK_RATE
from ..errors import validation_problems
from .routing import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_FLOOR, Policy

ENV_PREFIX = "PREFIX_CACHE_"
ENGINE_ENV_PREFIX = "PREFIX_CACHE_ENGINE_"  # serve-engine's settings
UpstreamKind = Literal["openai", "specprefill"]
AgentApi = Literal["messages", "responses"]
DEFAULT_EJECT_S = 5.0
# Names an earlier release read; set, they stop the service with the name to use instead.
RENAMED_ENV = {"PREFIX_CACHE_REDIS": "PREFIX_CACHE_REDIS_URL"}


def env_name(field: str, settings: type[BaseSettings] | None = None) -> str:
    """The one environment variable a field of ``settings`` (default: ``ServiceSettings``) is
    read from."""
    prefix = (settings or ServiceSettings).model_config.get("env_prefix") or ""
    return f"{prefix}{field.upper()}"


def _flag(flag: str, metavar: str | None = None, repeat: bool = False,
          switch: bool = False) -> dict[str, Any]:
    """A field's command-line flag (``flags.py`` makes it): ``repeat``: given several times;
    ``switch``: takes no value, sets True."""
    return {"flag": flag, "metavar": metavar, "repeat": repeat, "switch": switch}


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
    """Everything ``prefix-cache serve`` can be told (see the module docstring)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    host: str = Field(default="127.0.0.1", description="bind address",
                      json_schema_extra=_flag("--host"))
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port (0 picks a free one)",
                      json_schema_extra=_flag("--port"))
    workers: int = Field(default=1, ge=1, le=256, description="worker processes",
                         json_schema_extra=_flag("--workers"))
    model_dirs: Annotated[list[Path], NoDecode] = Field(
        default_factory=list, description="model folder, named after the folder (repeatable; "
        "the variable separates folders with os.pathsep)",
        json_schema_extra=_flag("--model", "DIR", repeat=True))
    models_file: Path | None = Field(
        default=None, description="YAML/JSON: name -> {folder, template, upstream, "
        "upstream_kind, upstream_model, engine, draft_model, engine_options, ...}",
        json_schema_extra=_flag("--models", "FILE"))
    upstream: Annotated[list[str] | None, NoDecode] = Field(
        default=None, description="OpenAI-compatible base URL for models that name no "
        "upstream; repeated: a pool of replicas of the model, routed by static prefix "
        "(the variable: comma-separated or a JSON list)",
        json_schema_extra=_flag("--upstream", "URL", repeat=True))
    upstream_routing: Policy | None = Field(
        default=None, description="how a pool of upstreams is routed: prefix_affinity (the "
        "default: a tenant's static prefix sticks to one replica, within a load bound), "
        "least_loaded, round_robin")
    upstream_load_factor: float = Field(
        default=DEFAULT_LOAD_FACTOR, ge=1.0, description="prefix_affinity's load bound: a "
        "replica over this many times the mean requests in flight passes a key to the next")
    upstream_load_floor: int = Field(
        default=DEFAULT_LOAD_FLOOR, ge=1, description="prefix_affinity: a replica with fewer "
        "requests in flight than this takes its keys whatever the mean (a spill costs a "
        "prefill of the whole static prefix elsewhere)")
    upstream_eject_s: float = Field(
        default=DEFAULT_EJECT_S, gt=0, description="how long a failing replica of a pool is "
        "left out (doubled per failure in a row, up to 16x)")
    upstream_kind: UpstreamKind = Field(
        default="openai", description="openai (body unchanged) | specprefill (adds "
        "specprefill_system_end, prompt_token_ids, specprefill_namespace)")
    upstream_model: str | None = Field(default=None, description="model name sent upstream "
                                       "(default: the client's)")
    upstream_api_key: str | None = Field(default=None,
                                         description="bearer key the sidecar sends upstream")
    upstream_apis: Annotated[list[AgentApi] | None, NoDecode] = Field(
        default=None, description="agent APIs the upstream serves itself, sent there as they "
        "are: messages, responses (comma-separated or JSON; default: both for kind "
        "specprefill, none for openai, whose agent requests go as chat completions)")
    upstream_default_max_tokens: int | None = Field(
        default=None, ge=1, description="output tokens the sidecar asks an upstream for when "
        "a request names no limit (chat max_tokens, Responses max_output_tokens); default: "
        "none sent, the upstream's own default applies (vLLM's: the context's end)")
    strict_hosted_tools: bool = Field(
        default=False, description="refuse (400) an agent request whose hosted tools "
        "(web_search ...) the target cannot run, instead of leaving them out of the prompt "
        "(said in the x-prefix-cache-dropped-tools header)")
    responses_store_bytes: int = Field(
        default=32 << 20, gt=0, description="bytes of recent /v1/responses one tenant's "
        "previous_response_id can refer to, per worker (with --redis: the largest one "
        "response kept in the shared store, where any worker or replica finds it)")
    responses_store_ttl_s: float = Field(
        default=24 * 3600.0, gt=0, description="with --redis: how long a stored response "
        "is kept in the shared store")
    engine: str | None = Field(
        default=None, description="run completions in-process on this engine instead of "
        "--upstream (mlx: the batched MLX engine; it needs --workers 1)",
        json_schema_extra=_flag("--engine", "mlx"))
    draft_model: Path | None = Field(
        default=None, description="SpecPrefill draft model of the engine (needs --engine mlx)",
        json_schema_extra=_flag("--draft-model", "DIR"))
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="an in-process engine's option, e.g. kv_bytes=8GiB, "
        "conversation_bytes=16GiB, max_context=32768 (repeatable; the variable is a JSON "
        "object; engine_adapter.options lists them)",
        json_schema_extra=_flag("--engine-option", "KEY=VALUE", repeat=True))
    redis_url: str | None = Field(
        default=None, description="shared store: redis://, rediss://, unix://, "
        "redis+cluster:// (default: in-process memory)",
        json_schema_extra=_flag("--redis", "URL"))
    redis_timeout_s: float = Field(
        default=0.05, gt=0, description="longest wait for Redis's answer before a lookup is "
        "computed instead; a timeout opens the circuit breaker")
    redis_connect_timeout_s: float = Field(
        default=1.0, gt=0, description="longest a new Redis connection may take to set up "
        "(connect and handshake; a burst of them queues on busy cores: not an outage), and "
        "longest a call waits for a free connection", json_schema_extra=_flag(
            "--redis-connect-timeout", "SECONDS"))
    redis_warm_connections: int = Field(
        default=32, ge=0, description="Redis connections each worker opens at start and "
        "reopens once Redis is back after errors (per client, at most its pool of 32)")
    keys_file: Path | None = Field(default=None, description="YAML/JSON {tenants: {KEY: "
                                   "tenant}, admin_keys: [...], metrics_keys: [...], "
                                   "tenant_limits: {tenant: {max_concurrency, max_queue, "
                                   "max_prompt_bytes, requests_per_minute, "
                                   "tokens_per_minute}}}; re-read on SIGHUP")
    api_keys: dict[str, str] = Field(default_factory=dict, description="JSON {KEY: tenant}; "
                                     "no keys anywhere: open service, namespace 'default'")
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="JSON list (or comma-separated) of admin keys")
    metrics_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="JSON list (or comma-separated) of keys that may "
        "read /metrics and /readyz details (admin keys may too); needed once any key exists")
    max_body_bytes: int = Field(default=8 << 20, gt=0,
                                description="request body limit; larger gets a 413")
    max_prompt_bytes: int = Field(default=2 << 20, gt=0, description="text one request gives "
                                  "the template (messages without media data, tools, kwargs, "
                                  "as JSON); larger gets a 413")
    tenant_max_concurrency: int = Field(default=2, gt=0, description="requests of one tenant "
                                        "prepared at once per worker (body to boundary)")
    tenant_max_queue: int = Field(default=128, ge=0, description="requests of one tenant "
                                  "waiting for a slot; more get a 429 with Retry-After")
    tenant_queue_timeout_s: float = Field(default=10.0, gt=0, description="longest wait for a "
                                          "slot; then a 429 with Retry-After")
    tenant_max_entries: int = Field(default=4096, gt=0,
                                    description="cache entries one tenant may hold")
    tenant_max_bytes: int = Field(default=64 << 20, gt=0,
                                  description="bytes one tenant's entries may take")
    upstream_timeout_s: float = Field(default=600.0, gt=0,
                                      description="longest wait for the next upstream byte")
    upstream_connect_timeout_s: float = Field(default=10.0, gt=0,
                                              description="upstream connect timeout")
    ready_timeout_s: float = Field(default=2.0, gt=0,
                                   description="per-check timeout of GET /readyz")
    upstream_first_byte_s: float = Field(
        default=10.0, gt=0, description="how long an upstream replica may take to start its "
        "answer before its health is checked; a failed check fails the request over to the "
        "next replica (a busy replica that answers its check keeps the request)")
    upstream_probe_interval_s: float = Field(
        default=2.0, gt=0, description="health checks of the replicas of a pool of several, "
        "in the background: an ejected replica is routed to again within one interval of "
        "being back")
    header_timeout_s: float = Field(default=10.0, gt=0, description="longest a connection may "
                                    "take to send a request's line and headers (from its "
                                    "opening, or the previous response's end); then closed")
    keep_alive_timeout_s: float = Field(default=5.0, gt=0, description="how long an idle "
                                        "kept-alive connection is kept")
    max_connections: int | None = Field(default=None, ge=1, description="open client "
                                        "connections at most, per worker; past it the one "
                                        "idle longest is closed (default: half the open-file "
                                        "limit, raised to its hard limit)")
    metrics_max_tenants: int = Field(default=20, gt=0, description="tenants with their own "
                                     "metrics label; the rest are folded into 'other'")
    tokenize_check_rate: float = Field(
        default=DEFAULT_CHECK_RATE, ge=0.0, le=1.0, description="fraction of prompts tokenized "
        "from a stored split that are re-tokenized in full and compared (a mismatch turns the "
        "fast path off for that tokenizer); below 1, checks take at most 1% of the time", json_schema_extra=_flag("--tokenize-check-rate", "RATE"))
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        default="info", description="log level")
    log_format: Literal["text", "json"] = Field(
        default="text", description="text | json (one JSON object per line, with the request id)",
        json_schema_extra=_flag("--log-format", "FORMAT"))
    shutdown_grace_s: float = Field(
        default=10.0, gt=0, description="on SIGTERM, how long requests in flight (streams "
        "included) may run on while new ones get 503")

    @field_validator("model_dirs", mode="before")
    @classmethod
    def _model_dirs(cls, value: Any) -> Any:
        return _split_list(value, os.pathsep)

    @field_validator("engine_options", mode="before")
    @classmethod
    def _engine_options(cls, value: Any) -> Any:
        return parse_key_values(value)

    @field_validator("admin_keys", "metrics_keys", mode="before")
    @classmethod
    def _key_lists(cls, value: Any) -> Any:
        return _split_list(value, ",")

    @field_validator("upstream_apis", mode="before")
    @classmethod
    def _upstream_apis(cls, value: Any) -> Any:
        return _split_list(value, ",")

    @field_validator("upstream", mode="before")
    @classmethod
    def _upstream(cls, value: Any) -> Any:
        urls = _split_list(value, ",") if value is not None else None
        return urls or None  # an exported-but-empty variable means "not set"

    @field_validator("redis_url", "upstream_model", "upstream_api_key", "engine")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        # An exported-but-empty variable (PREFIX_CACHE_REDIS_URL=) means "not set", not "".
        return value or None

    @property
    def uses_memory_store(self) -> bool:
        """True when hits live in each worker's own memory (no shared store)."""
        return not self.redis_url or self.redis_url.startswith("memory")


class EngineServerSettings(BaseSettings):
    """Everything ``prefix-cache serve-engine`` can be told; flags win over variables."""

    model_config = SettingsConfigDict(env_prefix=ENGINE_ENV_PREFIX, extra="ignore")

    model: Path | None = Field(default=None, description="mlx-lm model folder (default: the "
                               "demo chat model, SmolLM2-135M-Instruct, converted on first use)",
                               json_schema_extra=_flag("--model", "DIR"))
    draft_model: Path | None = Field(default=None, description="SpecPrefill draft model folder",
                                     json_schema_extra=_flag("--draft-model", "DIR"))
    host: str = Field(default="127.0.0.1", description="bind address",
                      json_schema_extra=_flag("--host"))
    port: int = Field(default=8001, ge=0, le=65535, description="TCP port",
                      json_schema_extra=_flag("--port"))
    trust_namespace: bool = Field(
        default=False, description="take the KV namespace from the request's "
        "specprefill_namespace (only behind a sidecar that alone can reach this port); "
        "otherwise all requests share namespace 'default'",
        json_schema_extra=_flag("--trust-namespace", switch=True))
    api_key: str | None = Field(default=None, description="require 'Authorization: Bearer "
                                "KEY' on /v1 and /metrics", json_schema_extra=_flag("--api-key",
                                                                                    "KEY"))
    options: dict[str, Any] = Field(
        default_factory=dict, description="an engine option, e.g. kv_bytes=8GiB, "
        "conversation_bytes=16GiB, max_context=32768, specprefill_keep_pct=0.2 (repeatable; "
        "engine_adapter.options lists them; the variable: JSON)",
        json_schema_extra=_flag("--engine-option", "KEY=VALUE", repeat=True))

    @field_validator("options", mode="before")
    @classmethod
    def _options(cls, value: Any) -> Any:
        return parse_key_values(value)

    @field_validator("api_key")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        return value or None


def check_renamed_env(environ: dict[str, str] | None = None) -> None:
    """ValueError naming the variable to use when a renamed one is set (a silent fallback to
    the default would serve, say, without the shared store)."""
    env = os.environ if environ is None else environ
    for old, new in RENAMED_ENV.items():
        if env.get(old):
            raise ValueError(f"{old} is not read: set {new} instead")


def setting_from_env(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting as ``serve`` reads it (its one variable, checked by the model's field), for
    the other commands that take it; its default when the variable is unset. ValueError (a
    pydantic ValidationError) names a bad value."""
    env = os.environ if environ is None else environ
    info = ServiceSettings.model_fields[name]
    raw = env.get(env_name(name))
    if not raw:
        return info.get_default(call_default_factory=True)
    try:
        return TypeAdapter(Annotated[info.annotation, info]).validate_python(raw)
    except ValidationError as exc:
        problems = validation_problems(exc)
        raise ValueError(f"{env_name(name)}={raw!r}: {problems}") from None

"""The engine protocol: what an API layer and an engine say to each other, and nothing else
(no HTTP, no API shapes, no mlx). Both sides import it; it imports neither.

    API layer (OpenAI chat, Anthropic Messages, OpenAI Responses) ── parses its body into
        BackendRequest(prompt ids, boundary, tenant, SamplingParams, SpecPrefillParams)
    backend.check(request)            the engine's own request (a CheckedBackendRequest):
                                      made and checked once, with what the engine fills in
                                      (max_tokens), or an InvalidRequestError (a 400) before
                                      anything runs
    backend.generate(checked)         BackendOutput text deltas (and tool calls, for engines
                                      that parse them out of the text when the request gives
                                      tools); the last one has the finish reason and the
                                      usage (one before the text may have the prompt's usage
                                      alone, once prefilled); closing the iterator cancels
    API layer ── formats the outputs in its own shape (JSON or SSE)

An engine is anything with these calls (``ChatBackend``); the sidecar finds one by name through
``prefix_cache.engine.lookup`` and never sees its internals. The stats types are what an engine
reports (``snapshot_stats``), read by the metrics layer. The wire field names are the extension
fields a sidecar sends an engine server over HTTP (``WIRE_FIELDS``).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, TypedDict, TypeVar

from ..util.token_ids import TokenIds

# The extension fields of a request body between a sidecar and an engine server.
SPECPREFILL_SYSTEM_END = "specprefill_system_end"  # the static prefix's end in the prompt ids
PROMPT_TOKEN_IDS = "prompt_token_ids"              # the prompt, already rendered and tokenized
SPECPREFILL_NAMESPACE = "specprefill_namespace"    # the tenant whose engine KV may be reused
SPECPREFILL = "specprefill"                        # per-request SpecPrefill knobs
SPECPREFILL_KEEP_PCT = "specprefill_keep_pct"
SPECPREFILL_THRESHOLD = "specprefill_threshold"
# What the sidecar alone sets (from its cache and its own API keys) ...
SIDECAR_FIELDS = (SPECPREFILL_SYSTEM_END, PROMPT_TOKEN_IDS, SPECPREFILL_NAMESPACE)
# ... and the per-request knobs a client may set (range-checked by the API's parser; they
# change how its own request is prefilled, never what it may reuse).
CLIENT_KNOBS = (SPECPREFILL, SPECPREFILL_KEEP_PCT, SPECPREFILL_THRESHOLD)
WIRE_FIELDS = SIDECAR_FIELDS + CLIENT_KNOBS
OWNED_FIELD_PREFIX = "specprefill"


def is_owned_field(name: str) -> bool:
    """Whether ``name`` is a field the sidecar or the engine protocol owns, so a client's body
    never carries it past the sidecar: the sidecar's fields, and every ``specprefill*`` name
    but the client's knobs (one a later engine may read must not be a client's to set)."""
    return name in SIDECAR_FIELDS or (name.startswith(OWNED_FIELD_PREFIX)
                                      and name not in CLIENT_KNOBS)


def without_owned_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a client's body without the fields it must not set (``is_owned_field``)."""
    return {k: v for k, v in body.items() if not is_owned_field(k)}


# An engine server's admin purge (``POST``, its API key as for every call): the body names the
# namespace whose KV and stored responses go (``null``: every namespace).
PURGE_PATH = "/admin/purge"
PURGE_NAMESPACE = "namespace"


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen and when generation ends."""

    max_tokens: int | None = None   # None: the backend's default, cut to the context left
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()      # generation ends where one first appears (not returned)


@dataclass(frozen=True, slots=True)
class SpecPrefillParams:
    """Per-request SpecPrefill knobs; None keeps the engine's own setting."""

    enabled: bool | None = None     # None: on when the engine has a draft and the rest is long
    keep_pct: float | None = None
    threshold: int | None = None


@dataclass(frozen=True, slots=True)
class OutputConstraints:
    """What the output must be, in chat completions' terms (every API layer translates its own
    fields into these): ``response_format`` (``json_object`` or ``json_schema``), ``tool_choice``
    ("auto", "none", "required" or ``{"type": "function", "function": {"name": ...}}``) and
    whether one turn may hold several calls. An engine that cannot honour what ``binding`` says
    refuses the request (a 400); it never serves free text as if it held."""

    response_format: Mapping[str, Any] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool = True

    @property
    def binding(self) -> bool:
        """Whether the output is bound: a JSON format, or a tool call that must come."""
        kind = (self.response_format or {}).get("type", "text")
        return kind != "text" or self.tool_choice not in (None, "auto", "none")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> OutputConstraints:
        """The constraints among a chat completion's options (fields not sent: defaults)."""
        return cls(options.get("response_format"), options.get("tool_choice"),
                   options.get("parallel_tool_calls") is not False)


@dataclass(frozen=True, slots=True)
class BackendRequest:
    """One generation: the prompt's token ids, its static-prefix boundary, the tenant whose KV
    it may reuse, and how to sample."""

    prompt_ids: Sequence[int] | TokenIds   # TokenIds: checked where they entered, packed
    specprefill_system_end: int = 0
    namespace: str = "default"
    sampling: SamplingParams = SamplingParams()
    specprefill: SpecPrefillParams = SpecPrefillParams()
    request_id: str = field(default_factory=new_request_id)
    # The tools the prompt offers: an engine that can parse tool calls does so only then.
    tools: Sequence[Mapping[str, Any]] | None = None
    constraints: OutputConstraints = OutputConstraints()


class CheckedBackendRequest(Protocol):
    """A request as an engine will run it (``ChatBackend.check``): the engine's own type, made
    and checked once, that ``generate`` takes back as it is, so nothing is checked or built
    twice. The API layer reads only ``request``: the request it came from, with what the
    engine filled in (max_tokens)."""

    @property
    def request(self) -> BackendRequest: ...


Checked = TypeVar("Checked", bound=CheckedBackendRequest)  # an engine's checked request


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one generation; ``cached_tokens``: prompt tokens whose KV was restored."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the model wrote; ``arguments`` is JSON text, as OpenAI's API sends it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallChunk:
    """A piece of a tool call as it is written: the first piece of call ``index`` has its id
    and name, the others add to its ``arguments`` (JSON text, whole once the call ends)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class BackendOutput:
    """A text delta (or tool calls); the last output of a generation carries its finish
    reason and usage. An engine that knows the prompt's counts once it is prefilled (how many
    tokens it restored) may say so first: an output with that usage and no finish reason."""

    text: str = ""
    finish_reason: str | None = None   # "stop", "length" or "tool_calls" on the last output
    usage: Usage | None = None
    stop_sequence: str | None = None   # the stop string that ended the generation, if one did
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_chunks: tuple[ToolCallChunk, ...] = ()   # calls streamed as they are written
    reasoning: str = ""   # a piece of the model's reasoning, apart from the answer's text


class BackendError(RuntimeError):
    """The engine could not finish a generation it had accepted (closed, a model step failed)."""


class EngineHealth(TypedDict, total=False):
    """What a readiness probe reports for an engine; ``ok`` is always there."""

    ok: bool
    active: int
    queued: int
    sparse_prefills: int
    disk_full: bool     # the KV disk tier's last write failed for space (it still serves)


def counted(counts: Any) -> dict[str, Any]:
    """A counts record's fields as keyword arguments of the stats that extend it (a copy)."""
    return {f.name: copy.copy(getattr(counts, f.name)) for f in fields(counts)}


@dataclass(slots=True)
class KVStoreCounts:
    """What an engine KV store counts as it runs (written under its lock)."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    rejected: int = 0       # snapshots larger than the whole store, not kept
    superseded: int = 0     # entries dropped by a longer prompt of the same conversation
    by_namespace: dict[str, int] = field(default_factory=dict)  # entries per namespace


@dataclass(slots=True)
class KVStoreStats(KVStoreCounts):
    """An engine KV store's figures: its counts and what it holds now."""

    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0


@dataclass(slots=True)
class DiskKVCounts:
    """What the engine's KV disk tier counts as it runs (both stores share the tier)."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_drops: int = 0    # the write queue was full (or the entry larger than the tier)
    write_errors: int = 0
    full_errors: int = 0    # writes that failed for a full disk even after evicting (in errors)
    evictions: int = 0
    discarded: int = 0      # bad files deleted: truncated, corrupt, another model's, old format
    loads: int = 0
    load_seconds: float = 0.0


@dataclass(slots=True)
class DiskKVStats(DiskKVCounts):
    """The disk tier's figures: its counts and what it holds now."""

    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    queued: int = 0
    disk_full: bool = False  # the last write failed for space even after evicting


@dataclass(slots=True)
class EngineCounts:
    """What an engine counts since it started (written by its thread only)."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    specprefill: int = 0
    fallbacks: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    parked: int = 0             # waited for a request computing the same static prefix
    conversation_hits: int = 0  # restored more than the static prefix from an earlier prompt
    reused_generated_tokens: int = 0  # of reused_tokens: an earlier reply's, sent back
    spec_decode_draft_tokens: int = 0     # speculative decoding: draft tokens verified
    spec_decode_accepted_tokens: int = 0  # of those, accepted (emitted without a step each)
    last_fallback: str | None = None


@dataclass(slots=True)
class EngineStats(EngineCounts):
    """An engine's figures (``snapshot_stats``, a copy): its counts, the requests running now,
    and its stores' figures (a store that is off is None)."""

    active: int = 0
    kv_store: KVStoreStats | None = None
    conversation_store: KVStoreStats | None = None
    kv_disk: DiskKVStats | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON for the dashboard; a store that is off is left out."""
        return {k: v for k, v in asdict(self).items() if v is not None or k == "last_fallback"}


class ChatBackend(Protocol[Checked]):
    """An engine the API layers generate with (see the module docstring), its checked request
    of its own type (``Checked``). One that honours
    binding ``OutputConstraints`` says so with ``constrained_decoding = True``; requests that
    need it are refused before reaching any other."""

    name: str
    tokenizer: Any  # the model's tokenizer: renders prompts that come without ids

    def check(self, request: BackendRequest) -> Checked:
        """The request as it will run; InvalidRequestError (a 400) when it cannot."""
        ...

    def generate(self, checked: Checked) -> AsyncGenerator[BackendOutput, None]:
        """The outputs of a checked request; BackendError if the engine fails meanwhile."""
        ...

    def health(self) -> EngineHealth: ...

    def snapshot_stats(self) -> EngineStats: ...

    def close(self) -> None: ...


class BackendFactory(Protocol):
    """What an engine package registers under a name (``--engine NAME``)."""

    def check_options(self, options: Mapping[str, Any]) -> None:
        """ValueError naming each bad engine option; loads nothing."""
        ...

    def load(self, folder: Path, draft: Path | None, *, name: str,
             options: Mapping[str, Any]) -> ChatBackend:
        """The engine for a model folder (and a draft); ValueError saying why if it cannot."""
        ...

    def serve(self, folder: Path, draft: Path | None, *, host: str, port: int,
              trust_namespace: bool, api_key: str | None,
              options: Mapping[str, Any]) -> int:
        """Run the engine as its own OpenAI-compatible server until stopped; the exit code."""
        ...

    def default_model(self) -> Path:
        """The model folder served when none is given (made on first use); ValueError saying
        what to install if it cannot be made."""
        ...

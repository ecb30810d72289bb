"""Configured models: each one's tokenizer and template, and where its completions go.

A model comes from ``--model DIR`` (named after its folder) or from a ``--models FILE`` entry::

    qwen3-8b:                         # the name clients send as "model"
      folder: /models/Qwen3-8B        # tokenizer files (relative paths: from the file's folder)
      template: qwen3.jinja           # optional, overrides the folder's chat template
      upstream: http://127.0.0.1:8080/v1
      # or a pool of replicas of the model, all of one kind and settings:
      # upstreams: [http://10.0.0.1:8080/v1, http://10.0.0.2:8080/v1]
      # routing: prefix_affinity      # a pool's policy (or least_loaded, round_robin)
      # routing_load_factor: 1.25     # prefix_affinity's load bound (c times the mean) ...
      # routing_load_floor: 4         # ... which never stops a replica below 4 in flight
      upstream_kind: openai           # or specprefill
      upstream_model: default_model   # optional: the name the upstream knows it by
      upstream_api_key: ...           # optional: the sidecar's key for that upstream
      upstream_health_path: /health   # optional: what GET /readyz probes
      upstream_apis: [messages, responses]  # optional: agent APIs the upstream serves itself
      upstream_default_max_tokens: 4096     # optional: the output limit of a request naming none
      engine: mlx                     # or: completions run in-process on the MLX engine
      draft_model: /models/Qwen3-0.6B # optional, with engine: the SpecPrefill draft
      engine_options: {kv_bytes: 8GiB} # optional, with engine: over --engine-option's

Fields an entry leaves out fall back to the settings (``--upstream`` -- repeated, a pool --,
``--engine``,
``--draft-model``, ``--engine-option`` and the ``PREFIX_CACHE_UPSTREAM_*`` variables; an
entry's ``engine_options`` are laid over the settings' key by key); an entry that names an
engine takes no default upstream, and one that names an upstream no default engine. A model
has an upstream or an engine, not both. With no model at all the demo model folder is served
(with ``--engine NAME``, that engine's default model: for mlx the demo chat model,
``engine_adapter.demo_model``).

The engine (``engine: mlx``) is a ``ChatBackend`` loaded from the model's folder (mlx-lm
weights next to the tokenizer files) by the factory registered under its name
(``prefix_cache.engine.lookup``), imported only then: a sidecar without engines never imports
mlx. It is fed the sidecar's own prompt ids and boundary, and the tenant as its KV namespace;
it runs in the worker process, so it needs ``--workers 1``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..cache.keys import model_label
from ..engine.lookup import EngineUnavailableError, engine_factory
from ..engine.protocol import ChatBackend
from ..errors import NoChatTemplateError, validation_problems
from ..http.errors import BadRequest, NotFound
from .config_files import read_config_file
from .pool import UpstreamPool
from .routing import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_FLOOR, Policy
from .settings import DEFAULT_EJECT_S, AgentApi, ServiceSettings, UpstreamKind
from .upstream import DEFAULT_HEALTH_PATH, Upstream, normalize_base_url

log = logging.getLogger("prefix_cache.service")

class ModelSpec(BaseModel):
    """One configured model, before anything is loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256)
    folder: Path
    template: Path | None = None
    upstream: str | None = None
    upstreams: list[str] | None = None  # a pool of replicas (``pool.py``), instead of upstream
    routing: Policy | None = None       # a pool's policy; None: prefix_affinity
    routing_load_factor: float = Field(default=DEFAULT_LOAD_FACTOR, ge=1.0)
    routing_load_floor: int = Field(default=DEFAULT_LOAD_FLOOR, ge=1)
    upstream_eject_s: float = Field(default=DEFAULT_EJECT_S, gt=0)
    upstream_kind: UpstreamKind = "openai"
    upstream_model: str | None = None
    upstream_api_key: str | None = None
    upstream_health_path: str = DEFAULT_HEALTH_PATH
    upstream_apis: list[AgentApi] | None = None
    upstream_default_max_tokens: int | None = Field(default=None, ge=1)
    engine: str | None = None
    draft_model: Path | None = None
    engine_options: dict[str, Any] = Field(default_factory=dict)

    @property
    def upstream_urls(self) -> list[str]:
        """The model's upstream replicas (none, one, or a pool)."""
        return list(self.upstreams or ([self.upstream] if self.upstream is not None else []))


def load_model_specs(settings: ServiceSettings,
                     demo_dir: Callable[[], Path] | None = None) -> list[ModelSpec]:
    """The models to serve, in order: the models file's, then ``--model`` folders, else the demo."""
    urls = settings.upstream or []
    defaults: dict[str, Any] = {
        "upstream": urls[0] if len(urls) == 1 else None,
        "upstreams": urls if len(urls) > 1 else None,
        "routing": settings.upstream_routing,
        "routing_load_factor": settings.upstream_load_factor,
        "routing_load_floor": settings.upstream_load_floor,
        "upstream_eject_s": settings.upstream_eject_s,
        "upstream_kind": settings.upstream_kind,
        "upstream_model": settings.upstream_model,
        "upstream_api_key": settings.upstream_api_key,
        "upstream_apis": settings.upstream_apis,
        "upstream_default_max_tokens": settings.upstream_default_max_tokens,
        "engine": settings.engine,
        "draft_model": settings.draft_model,
        "engine_options": settings.engine_options,
    }
    specs: list[ModelSpec] = []
    if settings.models_file is not None:
        specs.extend(_specs_from_file(settings.models_file, defaults))
    for folder in settings.model_dirs:
        specs.append(_spec({**defaults, "name": Path(folder).resolve().name, "folder": folder},
                           f"--model {folder}"))
    if not specs:
        if demo_dir is None and settings.engine is not None:
            # The engine's own default: the real demo chat model, converted on first use.
            demo_dir = engine_factory(settings.engine).default_model
        if demo_dir is None:
            from ..model_folders.demo import demo_model_dir

            demo_dir = demo_model_dir
        folder = demo_dir()
        specs.append(_spec({**defaults, "name": folder.name, "folder": folder}, "demo model"))
    _check(specs)
    engines = [s.name for s in specs if s.engine is not None]
    if engines and settings.workers > 1:
        raise ValueError(f"model(s) {', '.join(map(repr, engines))} run on the in-process engine, "
                         f"which needs --workers 1 (got {settings.workers}): the engine batches "
                         "requests itself, and each worker would load its own copy of the model")
    return specs


def _spec(data: dict[str, Any], where: str) -> ModelSpec:
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as exc:
        problems = validation_problems(exc)
        raise ValueError(f"{where}: {problems}") from None


def _specs_from_file(path: Path, defaults: dict[str, Any]) -> list[ModelSpec]:
    base = Path(path).resolve().parent
    specs = []
    for name, entry in read_config_file(path, "models file").items():
        where = f"models file {str(path)!r}, model {name!r}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: must be a mapping with at least 'folder'")
        data = {**defaults, **entry, "name": str(name)}
        if isinstance(entry.get("engine_options"), dict):
            if entry.get("engine", defaults["engine"]) is None:
                raise ValueError(f"{where}: engine_options are for the in-process engine: "
                                 "give engine: mlx too")
            data["engine_options"] = {**defaults["engine_options"], **entry["engine_options"]}
        named = [f for f in ("upstream", "upstreams") if entry.get(f) is not None]
        if len(named) == 2:
            raise ValueError(f"{where}: give one of 'upstream' and 'upstreams'")
        if entry.get("engine") is not None and not named:
            data["upstream"] = data["upstreams"] = None  # in-process: no default upstream
        if named and "engine" not in entry:
            data["engine"] = data["draft_model"] = None  # forwarded: no default engine
        if named:  # the entry's own upstream(s) replace the default ones
            other = "upstreams" if named[0] == "upstream" else "upstream"
            data[other] = None
        for field in ("folder", "template", "draft_model"):
            if isinstance(data.get(field), str):
                data[field] = base / Path(data[field]).expanduser()
        specs.append(_spec(data, where))
    return specs


def _check(specs: Sequence[ModelSpec]) -> None:
    labels: dict[str, str] = {}
    for spec in specs:
        if spec.draft_model is not None and spec.engine is None:
            raise ValueError(f"model {spec.name!r}: a draft model (--draft-model, draft_model) "
                             "is for the in-process engine: give --engine mlx (engine: mlx) too")
        if spec.engine is not None:
            _check_engine_options(spec)
        if spec.engine is not None and spec.upstream_urls:
            raise ValueError(f"model {spec.name!r}: has both an in-process engine and an "
                             "upstream; give one of --engine/engine and --upstream/upstream")
        if spec.upstreams is not None and not spec.upstreams:
            raise ValueError(f"model {spec.name!r}: 'upstreams' is empty")
        try:
            _check_pool(spec)
        except ValueError as exc:
            raise ValueError(f"model {spec.name!r}: {exc}") from None
        label = model_label(spec.name)
        if label in labels:
            # Keys carry the label in the clear; two models on one label could not be purged apart.
            raise ValueError(f"models {labels[label]!r} and {spec.name!r} have the same key "
                             f"label {label!r}: rename one")
        labels[label] = spec.name


def _check_pool(spec: ModelSpec) -> None:
    """Every upstream URL valid, none listed twice."""
    urls = [normalize_base_url(url) for url in spec.upstream_urls]
    for url in urls:
        if urls.count(url) > 1:
            raise ValueError(f"upstream {url!r} is listed twice")


def _check_engine_options(spec: ModelSpec) -> None:
    """Refuse an unknown engine or bad engine options before anything loads (no mlx)."""
    assert spec.engine is not None
    try:
        engine_factory(spec.engine).check_options(spec.engine_options)
    except ValueError as exc:
        raise ValueError(f"model {spec.name!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A loaded model: tokenizer, key label, and where completions go: an upstream, or an
    in-process engine; neither: boundaries only.

    ``upstream`` says how the model's upstream is called (kind, model name, key, APIs: the
    same for every replica); ``pool`` holds its replicas (one, for a lone upstream) and routes
    each request to one of them. Given an upstream and no pool, the pool is that upstream alone.
    """

    name: str
    label: str
    tokenizer: Any
    upstream: Upstream | None
    engine: ChatBackend | None = None
    pool: UpstreamPool | None = None

    def __post_init__(self) -> None:
        if self.pool is None and self.upstream is not None:
            object.__setattr__(self, "pool", UpstreamPool([self.upstream]))

    def require_pool(self) -> UpstreamPool:
        """The replicas to send a completion to (BadRequest as ``require_upstream``)."""
        self.require_upstream()
        assert self.pool is not None
        return self.pool

    def require_upstream(self) -> Upstream:
        if self.upstream is None:
            raise BadRequest(
                f"model {self.name!r} has no upstream and no engine: it serves "
                "/v1/prefix/boundary only (configure --upstream URL or 'upstream' in --models)",
                code="model_not_servable")
        return self.upstream


def load_model(spec: ModelSpec, loader: Callable[..., Any] | None = None) -> ServedModel:
    """Load one model's tokenizer; ValueError naming the model if it cannot serve."""
    from ..model_folders.model_dir import load_tokenizer

    try:
        tokenizer = (loader or load_tokenizer)(spec.folder, spec.template)
    except (NoChatTemplateError, ValueError, OSError) as exc:
        raise ValueError(f"model {spec.name!r}: {exc}") from exc
    upstream = pool = None
    if spec.upstream_urls:
        apis = None if spec.upstream_apis is None else tuple(spec.upstream_apis)
        replicas = [Upstream(url, spec.upstream_kind, model=spec.upstream_model,
                             api_key=spec.upstream_api_key,
                             health_path=spec.upstream_health_path, apis=apis,
                             default_max_tokens=spec.upstream_default_max_tokens)
                    for url in spec.upstream_urls]
        upstream = replicas[0]
        pool = UpstreamPool(replicas, spec.routing, load_factor=spec.routing_load_factor,
                            load_floor=spec.routing_load_floor, eject_s=spec.upstream_eject_s)
    engine = load_engine(spec) if spec.engine is not None else None
    return ServedModel(spec.name, model_label(spec.name), tokenizer, upstream, engine, pool)


def load_engine(spec: ModelSpec) -> ChatBackend:
    """The model's in-process engine, from the factory registered under its name."""
    assert spec.engine is not None
    try:
        return engine_factory(spec.engine).load(spec.folder, spec.draft_model, name=spec.name,
                                                options=spec.engine_options)
    except ValueError as exc:
        raise EngineUnavailableError(f"model {spec.name!r}: {exc}") from exc


class ModelRegistry:
    """The served models by name; the first one is the default."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("no models to serve")
        self._models = {m.name: m for m in models}

    @classmethod
    def from_specs(cls, specs: Sequence[ModelSpec]) -> ModelRegistry:
        loaded: list[ServedModel] = []
        try:
            for spec in specs:
                loaded.append(load_model(spec))
        except BaseException:
            cls._close_engines(loaded)  # a later model failed: stop the engines already started
            raise
        return cls(loaded)

    @staticmethod
    def _close_engines(models: Sequence[ServedModel]) -> None:
        for model in models:
            if model.engine is not None:
                try:
                    model.engine.close()
                except Exception:  # one engine failing to stop must not keep the others going
                    log.exception("could not close the engine of %s", model.name)

    def close(self) -> None:
        """Stop the in-process engines (each once)."""
        self._close_engines(list(self))

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (the default when it names none); NotFound otherwise."""
        if name is None:
            return next(iter(self._models.values()))
        model = self._models.get(name)
        if model is None:
            raise NotFound(f"the model {name!r} does not exist; served: {', '.join(self._models)}",
                           code="model_not_found")
        return model

    def by_label(self, label: str) -> ServedModel | None:
        return next((m for m in self._models.values() if m.label == label), None)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

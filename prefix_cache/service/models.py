"""Configured models: each one's tokenizer and template, and where its completions go.

A model comes from ``--model DIR`` (named after its folder) or from a ``--models FILE`` entry::

    qwen3-8b:                         # the name clients send as "model"
      folder: /models/Qwen3-8B        # tokenizer files (relative paths: from the file's folder)
      template: qwen3.jinja           # optional, overrides the folder's chat template
      upstream: http://127.0.0.1:8080/v1
      upstream_kind: openai           # or specprefill
      upstream_model: default_model   # optional: the name the upstream knows it by
      upstream_api_key: ...           # optional: the sidecar's key for that upstream
      upstream_health_path: /health   # optional: what GET /readyz probes
      engine: mlx                     # in-process engine: not available yet

Fields an entry leaves out fall back to the settings (``--upstream`` and the
``PREFIX_CACHE_UPSTREAM_*`` variables). With no model at all the demo model folder is served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import NoChatTemplateError
from ..keys import model_label
from .config_files import read_config_file
from .errors import BadRequest, NotFound
from .settings import ServiceSettings, UpstreamKind
from .upstream import DEFAULT_HEALTH_PATH, Upstream, normalize_base_url

ENGINES = ("mlx",)
ENGINE_UNAVAILABLE = (
    "the in-process MLX engine (--engine mlx, --draft-model) is not available yet: serve the "
    "model with an OpenAI-compatible server (e.g. `mlx_lm.server --model DIR`) and pass "
    "--upstream URL"
)


class EngineUnavailableError(ValueError):
    """A model asks for an in-process engine this build does not have."""


class ModelSpec(BaseModel):
    """One configured model, before anything is loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256)
    folder: Path
    template: Path | None = None
    upstream: str | None = None
    upstream_kind: UpstreamKind = "openai"
    upstream_model: str | None = None
    upstream_api_key: str | None = None
    upstream_health_path: str = DEFAULT_HEALTH_PATH
    engine: str | None = None
    draft_model: Path | None = None


def load_model_specs(settings: ServiceSettings,
                     demo_dir: Callable[[], Path] | None = None) -> list[ModelSpec]:
    """The models to serve, in order: the models file's, then ``--model`` folders, else the demo."""
    defaults: dict[str, Any] = {
        "upstream": settings.upstream,
        "upstream_kind": settings.upstream_kind,
        "upstream_model": settings.upstream_model,
        "upstream_api_key": settings.upstream_api_key,
        "engine": settings.engine,
        "draft_model": settings.draft_model,
    }
    specs: list[ModelSpec] = []
    if settings.models_file is not None:
        specs.extend(_specs_from_file(settings.models_file, defaults))
    for folder in settings.model_dirs:
        specs.append(_spec({**defaults, "name": Path(folder).resolve().name, "folder": folder},
                           f"--model {folder}"))
    if not specs:
        from ..demo import demo_model_dir

        folder = (demo_dir or demo_model_dir)()
        specs.append(_spec({**defaults, "name": folder.name, "folder": folder}, "demo model"))
    _check(specs)
    return specs


def _spec(data: dict[str, Any], where: str) -> ModelSpec:
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{where}: {problems}") from None


def _specs_from_file(path: Path, defaults: dict[str, Any]) -> list[ModelSpec]:
    base = Path(path).resolve().parent
    specs = []
    for name, entry in read_config_file(path, "models file").items():
        where = f"models file {str(path)!r}, model {name!r}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: must be a mapping with at least 'folder'")
        data = {**defaults, **entry, "name": str(name)}
        for field in ("folder", "template", "draft_model"):
            if isinstance(data.get(field), str):
                data[field] = base / Path(data[field]).expanduser()
        specs.append(_spec(data, where))
    return specs


def _check(specs: Sequence[ModelSpec]) -> None:
    labels: dict[str, str] = {}
    for spec in specs:
        if spec.engine is not None and spec.engine not in ENGINES:
            raise ValueError(f"model {spec.name!r}: unknown engine {spec.engine!r}; "
                             f"known: {', '.join(ENGINES)}")
        if spec.engine is not None or spec.draft_model is not None:
            raise EngineUnavailableError(f"model {spec.name!r}: {ENGINE_UNAVAILABLE}")
        if spec.upstream is not None:
            try:
                normalize_base_url(spec.upstream)
            except ValueError as exc:
                raise ValueError(f"model {spec.name!r}: {exc}") from None
        label = model_label(spec.name)
        if label in labels:
            # Keys carry the label in the clear; two models on one label could not be purged apart.
            raise ValueError(f"models {labels[label]!r} and {spec.name!r} have the same key "
                             f"label {label!r}: rename one")
        labels[label] = spec.name


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A loaded model: tokenizer, key label, upstream (None: boundaries only)."""

    name: str
    label: str
    tokenizer: Any
    upstream: Upstream | None

    def require_upstream(self) -> Upstream:
        if self.upstream is None:
            raise BadRequest(
                f"model {self.name!r} has no upstream and no engine: it serves "
                "/v1/prefix/boundary only (configure --upstream URL or 'upstream' in --models)",
                code="model_not_servable")
        return self.upstream


def load_model(spec: ModelSpec, loader: Callable[..., Any] | None = None) -> ServedModel:
    """Load one model's tokenizer; ValueError naming the model if it cannot serve."""
    from ..model_dir import load_tokenizer

    try:
        tokenizer = (loader or load_tokenizer)(spec.folder, spec.template)
    except (NoChatTemplateError, ValueError, OSError) as exc:
        raise ValueError(f"model {spec.name!r}: {exc}") from exc
    upstream = None
    if spec.upstream is not None:
        upstream = Upstream(spec.upstream, spec.upstream_kind, model=spec.upstream_model,
                            api_key=spec.upstream_api_key, health_path=spec.upstream_health_path)
    return ServedModel(spec.name, model_label(spec.name), tokenizer, upstream)


class ModelRegistry:
    """The served models by name; the first one is the default."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("no models to serve")
        self._models = {m.name: m for m in models}

    @classmethod
    def from_specs(cls, specs: Sequence[ModelSpec]) -> ModelRegistry:
        return cls([load_model(spec) for spec in specs])

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

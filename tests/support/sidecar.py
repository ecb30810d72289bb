"""The sidecar under test: an app from settings and served models, the keys callers present,
and requests no other test sends."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prefix_cache.cache.keys import model_label
from prefix_cache.service import ServiceSettings, create_app
from prefix_cache.service.served_models import ModelRegistry, ServedModel
from prefix_cache.service.upstream import Upstream

# Two tenants' API keys, for tests that only need tenants to exist and stay apart.
TENANT_KEYS = {"sk-acme": "acme", "sk-globex": "globex"}


def unique_system(tag: str = "") -> dict[str, str]:
    """A system message no other test sends: a guaranteed miss on first use."""
    return {"role": "system", "content": f"You are agent {tag}{uuid.uuid4().hex}."}


def served(name: str, tokenizer: Any, upstream: Upstream | None = None) -> ServedModel:
    return ServedModel(name, model_label(name), tokenizer, upstream)


def sidecar_app(*models: ServedModel, **settings: Any) -> Any:
    """The sidecar's app serving ``models``, with ``ServiceSettings(**settings)``."""
    return create_app(ServiceSettings(**settings), models=ModelRegistry(list(models)))


def engine_sidecar_app(model_dir: Path, **settings: Any) -> Any:
    """The sidecar serving ``model_dir`` on the in-process MLX engine (``serve --engine mlx``);
    no keys, models file or upstream comes from the environment."""
    return create_app(ServiceSettings(model_dirs=[model_dir], engine="mlx", keys_file=None,
                                      models_file=None, upstream=None, **settings))


def bearer(key: str) -> dict[str, str]:
    """The header a caller presents ``key`` in."""
    return {"authorization": f"Bearer {key}"}


def write_keys_file(path: Path, tenants: dict[str, str], admin_keys: Iterable[str] = (),
                    metrics_keys: Iterable[str] = ()) -> Path:
    """A keys file (YAML) at ``path``: tenant keys -> namespaces, admin and metrics keys."""
    lines = ["tenants:", *(f"  {key}: {tenant}" for key, tenant in tenants.items())]
    for kind, keys in (("admin_keys", list(admin_keys)), ("metrics_keys", list(metrics_keys))):
        if keys:
            lines += [f"{kind}:", *(f"  - {key}" for key in keys)]
    path.write_text("\n".join(lines) + "\n")
    return path

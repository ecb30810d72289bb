"""The sidecar under test: served models and requests no other test sends."""

from __future__ import annotations

import uuid
from typing import Any

from prefix_cache.keys import model_label
from prefix_cache.service.models import ServedModel
from prefix_cache.service.upstream import Upstream


def unique_system(tag: str = "") -> dict[str, str]:
    """A system message no other test sends: a guaranteed miss on first use."""
    return {"role": "system", "content": f"You are agent {tag}{uuid.uuid4().hex}."}


def served(name: str, tokenizer: Any, upstream: Upstream | None = None) -> ServedModel:
    return ServedModel(name, model_label(name), tokenizer, upstream)

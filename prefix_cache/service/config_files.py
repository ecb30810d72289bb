"""Reading the service's YAML/JSON configuration files (models, keys)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def read_config_file(path: Path, what: str) -> dict[str, Any]:
    """The top-level mapping of a YAML or JSON file (YAML parses JSON too); ValueError if bad."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text) if Path(path).suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"{what} {str(path)!r} is not valid YAML/JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(path)!r} must hold a mapping at the top level")
    return data

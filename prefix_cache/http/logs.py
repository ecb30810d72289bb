"""uvicorn's logging setup with the project's loggers added, for every server and worker."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any


def uvicorn_log_config(level: str, loggers: Sequence[str] = ("prefix_cache",)) -> dict[str, Any]:
    """uvicorn's ``LOGGING_CONFIG`` plus ``loggers`` on its default handler at ``level``."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for name in loggers:
        config["loggers"][name] = {"handlers": ["default"], "level": level.upper(),
                                   "propagate": False}
    return config

"""Logging for every server and worker: uvicorn's setup with the project's loggers added, as
text or as JSON lines (one object per record, with the request id)."""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

from .request_id import current_request_id

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = ("text", "json")
# uvicorn's access line: (client, method, path with query, http version, status)
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (the current request's, or None outside one) to every record, and
    ``request_id_text`` for text lines (`` request_id=ID``, or nothing outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = current_request_id.get()
        record.request_id = rid
        record.request_id_text = f" request_id={rid}" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, request id;
    uvicorn's access lines as fields; the traceback, if any, as text."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        args = record.args
        if record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5:
            out.update(zip(_ACCESS_FIELDS, args, strict=True))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def uvicorn_log_config(level: str, loggers: Sequence[str] = ("prefix_cache",),
                       log_format: str = "text") -> dict[str, Any]:
    """uvicorn's ``LOGGING_CONFIG`` plus ``loggers`` on its default handler at ``level``; with
    ``log_format="json"`` every handler writes JSON lines."""
    from uvicorn.config import LOGGING_CONFIG

    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    config = copy.deepcopy(LOGGING_CONFIG)
    for name in loggers:
        config["loggers"][name] = {"handlers": ["default"], "level": level.upper(),
                                   "propagate": False}
    config["filters"] = {"request_id": {"()": f"{__name__}.RequestIdFilter"}}
    for handler in config["handlers"].values():
        handler["filters"] = ["request_id"]
    for name, formatter in config["formatters"].items():
        if log_format == "json":
            config["formatters"][name] = {"()": f"{__name__}.JsonFormatter"}
        else:  # text: the line as uvicorn writes it, then the request's id (access lines too)
            formatter["fmt"] = formatter["fmt"] + "%(request_id_text)s"
    return config

"""Logging for every server and worker: uvicorn's setup with the project's loggers added, as
text or as JSON lines (one object per record, with the request id)."""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from .request_id import current_request_id

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = ("text", "json")
# uvicorn's access line: (client, method, path with query, http version, status)
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")
LOG_BURST, LOG_WINDOW_S = 20, 10.0  # records of one kind let through per window
MAX_LOG_KINDS = 10_000


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (the current request's, or None outside one) to every record, and
    ``request_id_text`` for text lines (`` request_id=ID``, or nothing outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = current_request_id.get()
        record.request_id = rid
        record.request_id_text = f" request_id={rid}" if rid else ""
        return True


class RateLimitFilter(logging.Filter):
    """At most ``burst`` records of one kind (logger and message template) per ``window_s``;
    the first one let through after a suppression says how many were dropped. A flood (idle
    connections, a failing upstream) then costs a few lines a second, not the disk."""

    def __init__(self, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.window_s, self._clock = burst, window_s, clock
        self._lock = threading.Lock()
        self._kinds: dict[tuple[str, Any], list[float]] = {}  # [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        key = (record.name, record.msg)
        with self._lock:
            if len(self._kinds) > MAX_LOG_KINDS:
                self._kinds.clear()  # message templates are few; a flood of distinct ones is not
            kind = self._kinds.setdefault(key, [now, 0, 0])
            if now - kind[0] >= self.window_s:
                dropped = int(kind[2])
                kind[:] = [now, 0, 0]
                if dropped:
                    record.msg = f"[{dropped} similar lines suppressed] {record.msg}"
            kind[1] += 1
            if kind[1] <= self.burst:
                return True
            kind[2] += 1
            return False


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
    # asyncio's own errors (accept failing for want of file descriptors) go through the same
    # handler and rate limit instead of Python's last-resort handler.
    for name in (*loggers, "asyncio"):
        config["loggers"][name] = {"handlers": ["default"], "level": level.upper(),
                                   "propagate": False}
    config["filters"] = {"rate_limit": {"()": f"{__name__}.RateLimitFilter"},
                         "request_id": {"()": f"{__name__}.RequestIdFilter"}}
    for name, handler in config["handlers"].items():
        # Access lines are one per request answered (bounded by the requests); every other
        # line, one kind at a time, by the rate limit.
        handler["filters"] = ["request_id"] + ([] if name == "access" else ["rate_limit"])
    for name, formatter in config["formatters"].items():
        if log_format == "json":
            config["formatters"][name] = {"()": f"{__name__}.JsonFormatter"}
        else:  # text: the line as uvicorn writes it, then the request's id (access lines too)
            formatter["fmt"] = formatter["fmt"] + "%(request_id_text)s"
    return config

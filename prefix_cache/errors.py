"""The exceptions the library raises; each maps to one HTTP status in the service."""

from __future__ import annotations

from typing import Any


class PrefixCacheError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidRequestError(PrefixCacheError, ValueError):
    """The request itself is malformed (roles, types, reserved kwargs): the client's fault, a 400.

    ``code`` is the machine-readable reason a server puts in its error body.
    """

    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class ContextLengthError(InvalidRequestError):
    """The prompt and the tokens asked for do not fit in the model's context window."""

    code = "context_length_exceeded"


class NoChatTemplateError(PrefixCacheError):
    """The tokenizer has no chat template and none was given."""


class TemplateRenderError(PrefixCacheError):
    """The chat template raised while rendering; the message is the template's own."""


class StoreUnavailableError(PrefixCacheError):
    """A store could not answer (down, slow, full). The cache treats it as a miss, never as a failure."""


class StoreBusyError(StoreUnavailableError):
    """Every connection to the store stayed busy for the whole wait: the server is up and
    answering others, so this costs one caller a recompute and never opens the circuit."""


class EntryError(PrefixCacheError):
    """A stored entry is corrupt, of another format version, or belongs to other inputs."""


def validation_problems(exc: Any, whole: str = "") -> str:
    """A pydantic ``ValidationError`` of configuration as one line: ``loc: msg; loc: msg``
    (``whole``: the name given to an error of the whole value, which has no location). Bodies
    of HTTP requests have their own wording, in ``http.errors``."""
    parts = []
    for e in exc.errors():
        where = ".".join(map(str, e["loc"])) or whole
        parts.append(f"{where}: {e['msg']}" if where else e["msg"])
    return "; ".join(parts)


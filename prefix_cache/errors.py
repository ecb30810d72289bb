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
    """The prompt and the tokens asked for do not fit in the model's context window.

    Each API words it as its clients key on it (Claude Code compacts on Anthropic's
    ``prompt is too long: N tokens > M maximum``; OpenAI's clients read the code
    ``context_length_exceeded``): ``anthropic_message`` and ``openai_message``."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, prompt_tokens: int | None = None,
                 max_tokens: int = 0, context_length: int | None = None) -> None:
        super().__init__(message)
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.context_length = context_length

    def anthropic_message(self) -> str:
        """Anthropic's own wording: the prompt alone over the context, or with max_tokens."""
        n, m, limit = self.prompt_tokens, self.max_tokens, self.context_length
        if n is None or limit is None:
            return str(self)
        if n >= limit:
            return f"prompt is too long: {n} tokens > {limit} maximum"
        return (f"input length and `max_tokens` exceed context limit: {n} + {m} > {limit}, "
                "decrease input length or `max_tokens` and try again")

    def openai_message(self) -> str:
        """OpenAI's wording (the code says the rest)."""
        n, m, limit = self.prompt_tokens, self.max_tokens, self.context_length
        if n is None or limit is None:
            return str(self)
        if n >= limit:
            return (f"This model's maximum context length is {limit} tokens. However, your "
                    f"messages resulted in {n} tokens. Please reduce the length of the messages.")
        return (f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n + m} tokens ({n} in the messages, {m} in the completion). "
                "Please reduce the length of the messages or completion.")


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


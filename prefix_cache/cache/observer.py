"""Events a cache reports as they happen: the one source every counter is tallied from (the
cache's own ``CacheStats``, the service's Prometheus metrics), recorded at event time because
Prometheus multiprocess mode cannot read another worker's in-memory counters."""

from __future__ import annotations


class CacheObserver:
    """No-op base: subclass and override what you record. Called inline: keep it cheap."""

    def resolved(self, *, cache: str, namespace: str, model: str, seconds: float,
                 static_tokens: int, boundary: int) -> None:
        """A request got its answer; ``cache`` is hit, miss or none; ``seconds`` end to end."""

    def failed(self, *, namespace: str, model: str, error: Exception) -> None:
        """A request failed (bad input, template error)."""

    def computed(self, *, model: str, seconds: float, static_tokens: int, renders: int = 2) -> None:
        """A static-prefix computation ran ``renders`` probe renders and took ``seconds``."""

    def saved(self, *, model: str, seconds: float) -> None:
        """A hit skipped a computation that had cost ``seconds``."""

    def waited(self) -> None:
        """A miss waited for another request's computation of the same key."""

    def prompt_rendered(self) -> None:
        """The real prompt was rendered (the caller gave no prompt ids)."""

    def cap_rendered(self) -> None:
        """One more render located a request's first non-static text (templates that move the
        static text, requests past the stored cap)."""

    def store_error(self, *, op: str) -> None:
        """A store call failed and was treated as a miss."""

    def verification_failure(self) -> None:
        """A stored entry was rejected (corrupt, foreign, collision)."""

    def tokenized(self, *, model: str, fast: bool, reason: str) -> None:
        """A rendered prompt was tokenized: from its entry's split (``fast``), or whole, and
        ``reason`` why (see ``prompt_tokens``)."""

    def tokenize_checked(self, *, model: str, mismatch: bool) -> None:
        """A sampled check compared a fast tokenization with a full one."""

    def fast_path_off(self, *, model: str, reason: str) -> None:
        """Fast tokenization is off for a tokenizer, or a static text has no safe split."""


class ObserverGroup(CacheObserver):
    """Several observers as one: each event goes to all of them, in order."""

    def __init__(self, *observers: CacheObserver) -> None:
        self.observers = observers

    def resolved(self, *, cache: str, namespace: str, model: str, seconds: float,
                 static_tokens: int, boundary: int) -> None:
        for o in self.observers:
            o.resolved(cache=cache, namespace=namespace, model=model, seconds=seconds,
                       static_tokens=static_tokens, boundary=boundary)

    def failed(self, *, namespace: str, model: str, error: Exception) -> None:
        for o in self.observers:
            o.failed(namespace=namespace, model=model, error=error)

    def computed(self, *, model: str, seconds: float, static_tokens: int, renders: int = 2) -> None:
        for o in self.observers:
            o.computed(model=model, seconds=seconds, static_tokens=static_tokens, renders=renders)

    def saved(self, *, model: str, seconds: float) -> None:
        for o in self.observers:
            o.saved(model=model, seconds=seconds)

    def waited(self) -> None:
        for o in self.observers:
            o.waited()

    def prompt_rendered(self) -> None:
        for o in self.observers:
            o.prompt_rendered()

    def cap_rendered(self) -> None:
        for o in self.observers:
            o.cap_rendered()

    def store_error(self, *, op: str) -> None:
        for o in self.observers:
            o.store_error(op=op)

    def verification_failure(self) -> None:
        for o in self.observers:
            o.verification_failure()

    def tokenized(self, *, model: str, fast: bool, reason: str) -> None:
        for o in self.observers:
            o.tokenized(model=model, fast=fast, reason=reason)

    def tokenize_checked(self, *, model: str, mismatch: bool) -> None:
        for o in self.observers:
            o.tokenize_checked(model=model, mismatch=mismatch)

    def fast_path_off(self, *, model: str, reason: str) -> None:
        for o in self.observers:
            o.fast_path_off(model=model, reason=reason)

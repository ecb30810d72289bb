"""Events a cache reports as they happen, for metrics that must be recorded at event time
(Prometheus multiprocess mode cannot read another worker's in-memory counters)."""

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

    def store_error(self, *, op: str) -> None:
        """A store call failed and was treated as a miss."""

    def verification_failure(self) -> None:
        """A stored entry was rejected (corrupt, foreign, collision)."""

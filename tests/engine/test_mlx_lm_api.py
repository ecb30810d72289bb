"""The mlx-lm the engine needs: the range pyproject pins is the one the code states and the one
installed, and a release without the batch API's names fails at import saying which it needs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import version

import pytest
from packaging.specifiers import SpecifierSet

from tests.support.paths import REPO


def pinned_range() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = [d for d in deps["mlx"] if d.startswith("mlx-lm")]
    return spec.removeprefix("mlx-lm").split(";")[0].strip()


def test_the_stated_range_is_pyprojects_and_holds_the_installed_release():
    from engine_adapter.mlx_engine.model_info import MLX_LM_RANGE

    assert MLX_LM_RANGE == pinned_range()
    assert version("mlx-lm") in SpecifierSet(MLX_LM_RANGE)


@pytest.mark.parametrize("name", ["BatchGenerator", "StopSequences"])
def test_a_release_without_the_batch_names_says_which_mlx_lm_it_needs(name):
    # The installed mlx-lm with one name taken away: what a release that renamed it looks like.
    code = (f"import sys, mlx_lm.generate; del sys.modules['mlx_lm.generate'].{name}\n"
            "try:\n    import engine_adapter.mlx_engine\n"
            "except ImportError as exc:\n    print(exc)\nelse:\n    print('imported')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO, check=True).stdout
    assert f"needs mlx-lm{pinned_range()}" in out
    assert name in out and f"mlx-lm {version('mlx-lm')} is installed" in out

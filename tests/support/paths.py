"""Where things are: this repository, its deploy folder, the chat templates the template suites
run over, where browser tests leave screenshots, and OpenBLAS for mlx server processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
GRAFANA_DASHBOARD = DEPLOY / "grafana" / "prefix-cache-dashboard.json"
# Screenshots the browser tests leave for people to look at (CI keeps the folder).
ARTIFACTS = Path(os.environ.get("PREFIX_CACHE_ARTIFACTS", REPO / "artifacts"))

SHARED_TEMPLATES = REPO.parent / "shared" / "chat_templates"
# The real chat templates the template suites run over (../shared, or PREFIX_CACHE_TEMPLATES);
# none there, and those suites skip themselves.
TEMPLATES_DIR = Path(os.environ.get("PREFIX_CACHE_TEMPLATES", SHARED_TEMPLATES))
TEMPLATE_STEMS = (sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))
                  if TEMPLATES_DIR.is_dir() else [])
needs_templates = pytest.mark.skipif(not TEMPLATE_STEMS, reason=f"no chat templates at {TEMPLATES_DIR}")

# mlx's CPU wheel bundles the reference BLAS, ~20-40x slower at a model's matmuls than OpenBLAS
# where installed: a server process a test starts gets it preloaded (LD_PRELOAD), and the test
# process loads it itself before anything imports mlx (use_openblas, called by the root conftest).
OPENBLAS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
            "/lib/x86_64-linux-gnu/libopenblas.so.0")


def openblas() -> str | None:
    """The first OpenBLAS library installed here, if any."""
    return next((p for p in OPENBLAS if os.path.isfile(p)), None)


def use_openblas() -> str | None:
    """Load OpenBLAS into this process's global symbol scope, where installed, so mlx (imported
    later) resolves its BLAS calls there before its bundled reference BLAS: in-process engine
    tests then run at the speed a server process with LD_PRELOAD does. Returns the library."""
    import ctypes
    import sys

    blas = openblas()
    if blas is None or "mlx.core" in sys.modules:  # too late: its symbols are already bound
        return None
    ctypes.CDLL(blas, mode=os.RTLD_GLOBAL)
    return blas


def blas_env() -> dict[str, str]:
    """What a server process a test starts needs in its environment to run mlx on OpenBLAS
    (nothing where it is not installed)."""
    blas = openblas()
    return {"LD_PRELOAD": blas} if blas else {}

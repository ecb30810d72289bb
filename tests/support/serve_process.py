"""A ``prefix-cache serve`` process on a free port, its log read line by line; and a
``prefix-cache serve-engine`` process on a given port: started, stopped (SIGSTOP), killed
(SIGKILL) and started again on the same port, as an operator's replica is."""

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

import httpx

from .loopback import free_port, local_client
from .paths import REPO, blas_env, openblas
from .server_thread import STARTUP_TIMEOUT_S

SERVE_STARTUP_TIMEOUT_S = 180.0  # a `prefix-cache serve` process: imports, model, engine (2 min
# seen at load 15 on 2 cores: a bound against hangs, not a timing)


class ServeProcess:
    """``python -m prefix_cache.cli serve`` on a free port, its log read line by line."""

    def __init__(self, args: list[str], home: Path, env: dict[str, str] | None = None) -> None:
        engine = blas_env() if "--engine" in args else {}   # mlx on OpenBLAS; else as is
        env = {**os.environ, "PREFIX_CACHE_HOME": str(home), "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", **engine, **(env or {})}
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


ENGINE_STARTUP_TIMEOUT_S = 120.0


class EngineProcess:
    """``python -m prefix_cache.cli serve-engine`` on the tiny model, its log in a file."""

    def __init__(self, model_dir: Path, log_dir: Path, *args: str) -> None:
        self.model_dir, self.log_dir, self.args = model_dir, log_dir, args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> EngineProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        blas = openblas()  # mlx's CPU backend is slow on the reference BLAS
        if blas:
            env["LD_PRELOAD"] = blas
        self.starts += 1
        log = open(self.log_dir / f"serve-engine-{self.port}-{self.starts}.log", "wb")
        with log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefix_cache.cli", "serve-engine", "--model",
                 str(self.model_dir), "--port", str(self.port), *self.args],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + ENGINE_STARTUP_TIMEOUT_S
        with local_client(timeout=2.0) as client:
            while True:  # readiness poll, bounded
                assert self.proc is not None
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve-engine did not start: {self.log()[-3000:]}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)

    def log(self) -> str:
        return "".join(p.read_text(errors="replace")
                       for p in sorted(self.log_dir.glob(f"serve-engine-{self.port}-*.log")))

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

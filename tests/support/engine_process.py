"""A ``prefix-cache serve-engine`` process on a given port: started, stopped (SIGSTOP), killed
(SIGKILL) and started again on the same port, as an operator's replica is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .loopback import free_port, local_client
from .paths import REPO, openblas

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

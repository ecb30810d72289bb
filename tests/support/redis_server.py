"""Real redis-server processes for tests: single servers and a 3-master cluster, on free ports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from redis import Redis

from .loopback import free_port
from .waits import wait_until

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server on loopback; kill, hang (SIGSTOP), resume and restart it."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: _answers(self.port), f"redis on {self.port}")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self) -> Redis:
        """A redis-py client of the test's own (not a store's), to read and write keys directly."""
        return Redis.from_url(self.url)

    def cli(self, *args: str) -> str:
        return subprocess.run([REDIS_CLI, "-p", str(self.port), *args], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.resume()
        self.kill()


class RedisCluster:
    """Three masters with cluster-enabled, joined with redis-cli --cluster create."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [
            RedisServer(workdir / f"node{i}", free_port(cluster_bus=True), "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        subprocess.run([REDIS_CLI, "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       capture_output=True, timeout=30, check=True)
        wait_until(lambda: all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes),
                   "cluster_state:ok", timeout=20)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

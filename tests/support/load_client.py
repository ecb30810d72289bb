"""Load for the fault tests: many agents' chat completions at once from a background thread, each
answer checked against the uncached reference boundary; and the leak checks that follow
(tasks left on a server's event loop, TCP connections a process holds).

Every wait is bounded; nothing here asserts how fast anything is.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import reference
from .tools import make_tools


@dataclass(frozen=True)
class Agent:
    """One agent: a static prefix (system prompt + tools) it sends on every turn."""

    name: str
    system: str
    tools: list[dict[str, Any]]

    def body(self, turn: int, model: str = "rec", stream: bool = False,
             recorder: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": model, "max_tokens": 4, "stream": stream, "tools": self.tools,
            "messages": [{"role": "system", "content": self.system},
                         {"role": "user", "content": f"Turn {turn % 3}: fix module_{turn % 3}.py"}]}
        if recorder:
            out["recorder"] = recorder
        return out


def make_agents(n: int, tag: str) -> list[Agent]:
    return [Agent(f"{tag}-{i}", f"You are agent {tag}-{i}. Work carefully.",
                  make_tools(1 + i % 4, seed=i)) for i in range(n)]


class Truth:
    """The uncached reference boundary of each request, computed once per distinct body."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._known: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def __call__(self, agent: Agent, turn: int) -> int:
        key = (agent.name, turn % 3)
        with self._lock:
            if key not in self._known:
                body = agent.body(turn)
                self._known[key] = reference.exact(self.tokenizer, body["messages"], body["tools"])
            return self._known[key]


@dataclass
class Tally:
    """What the clients saw."""

    statuses: Counter[int] = field(default_factory=Counter)
    caches: Counter[str] = field(default_factory=Counter)
    wrong: list[tuple[str, int, int]] = field(default_factory=list)    # (agent, got, truth)
    transport_errors: Counter[str] = field(default_factory=Counter)
    bodies: dict[int, set[str]] = field(default_factory=dict)         # error status -> codes

    @property
    def total(self) -> int:
        return sum(self.statuses.values()) + sum(self.transport_errors.values())


class LoadThread:
    """``clients`` concurrent clients sending ``make_body(agent, turn)`` round robin over the
    agents until stopped (or ``limit`` requests); every 200 is checked against ``truth``."""

    def __init__(self, base: str, agents: list[Agent], truth: Truth, clients: int = 8,
                 make_body: Callable[[Agent, int], dict[str, Any]] | None = None,
                 pause_s: float = 0.0, fresh_connections: bool = False,
                 limit: int | None = None) -> None:
        self.base = base
        self.agents = agents
        self.truth = truth
        self.clients = clients
        self.make_body = make_body or (lambda agent, turn: agent.body(turn))
        self.pause_s = pause_s
        self.fresh_connections = fresh_connections
        self.limit = limit
        self.tally = Tally()
        self._stop = threading.Event()
        self._sent = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> LoadThread:
        for agent in self.agents:  # the references first: the load is about the sidecar
            for turn in range(3):
                self.truth(agent, turn)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> Tally:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError("the load clients did not stop")
        return self.tally

    def wait_for(self, requests: int, timeout: float = 60.0) -> None:
        """Until at least ``requests`` more answers arrived."""
        target = self.tally.total + requests
        deadline = time.monotonic() + timeout
        while self.tally.total < target:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise AssertionError(f"the load made no progress: {self.tally}")
            time.sleep(0.02)

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.clients,
                              max_keepalive_connections=0 if self.fresh_connections else self.clients)
        async with httpx.AsyncClient(base_url=self.base, trust_env=False, timeout=30.0,
                                     limits=limits) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        turn = index
        while not self._stop.is_set() and (self.limit is None or self._sent < self.limit):
            self._sent += 1
            agent = self.agents[turn % len(self.agents)]
            await self._one(client, agent, turn)
            turn += self.clients
            if self.pause_s:
                await asyncio.sleep(self.pause_s)

    async def _one(self, client: httpx.AsyncClient, agent: Agent, turn: int) -> None:
        body = self.make_body(agent, turn)
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                content = await r.aread()
        except httpx.HTTPError as exc:
            self.tally.transport_errors[type(exc).__name__] += 1
            return
        self.tally.statuses[r.status_code] += 1
        if r.status_code != 200:
            try:
                code = str(httpx.Response(200, content=content).json()["error"].get("code"))
            except Exception:
                code = content[:80].decode(errors="replace")
            self.tally.bodies.setdefault(r.status_code, set()).add(code)
            return
        self.tally.caches[r.headers.get("x-prefix-cache", "?")] += 1
        got = int(r.headers["x-specprefill-system-end"])
        truth = self.truth(agent, turn)
        if got != truth:
            self.tally.wrong.append((agent.name, got, truth))


# -- leak checks ---------------------------------------------------------------------------------


def loop_of(server_thread: Any) -> asyncio.AbstractEventLoop:
    """The event loop a ``ServerThread``'s uvicorn runs on."""
    return server_thread.server.servers[0].get_loop()


def tasks_on(loop: asyncio.AbstractEventLoop) -> int:
    """Tasks alive on ``loop`` (not counting the one that counts them)."""
    async def count() -> int:
        return len(asyncio.all_tasks()) - 1
    return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout=10)


def wait_for_tasks(loop: asyncio.AbstractEventLoop, at_most: int, timeout: float = 20.0) -> int:
    """Until ``loop`` runs at most ``at_most`` tasks (requests and streams finished, nothing
    left behind); the count seen last."""
    deadline = time.monotonic() + timeout
    while True:
        n = tasks_on(loop)
        if n <= at_most or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def tcp_connections(pid: int, remote_port: int) -> int:
    """Established TCP connections of process ``pid`` to ``remote_port`` on loopback."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            port = int(fields[2].rsplit(":", 1)[1], 16)
            if port == remote_port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


def report(test: str, tally: Tally, **figures: Any) -> None:
    """One line of figures (shown with ``pytest -s``), for docs/reliability.md."""
    out = {"requests": tally.total, "statuses": dict(tally.statuses), "caches": dict(tally.caches),
           "wrong_boundaries": len(tally.wrong), "transport_errors": dict(tally.transport_errors),
           **figures}
    print(f"FAULT-FIGURES {test} {json.dumps(out, default=str)}", flush=True)

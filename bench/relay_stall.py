"""What a relayed hit adds in front of an upstream that writes its answer in pieces without
TCP_NODELAY (Python's ``http.server``, which ``mlx_lm.server`` is) and in front of uvicorn,
with the sidecar's upstream client as it was (httpx's defaults) and as it is now
(``prefix_cache/http/upstream_client.py``: TCP_NODELAY, quick ACKs before every read), side by
side in one run.

Per upstream kind, one upstream answering a canned chat completion at once, and two sidecars
(`prefix-cache serve`'s app on uvicorn, the demo model) in front of it, one per client. An
agent-sized body (~27 KB: a 10 KB system prompt and 7 tools). In a freshly shuffled order per
round: the body straight to the upstream on a fresh connection (what the client would pay
without us), and through each sidecar on a kept-alive connection: a hit (the same static
prefix) and a miss (a new one each time). Medians, and what each adds to the direct call.

    PYTHONPATH=$PWD python bench/relay_stall.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefix_cache.http import upstream_client as upstream_client_module  # noqa: E402
from prefix_cache.model_folders.demo import demo_model_dir  # noqa: E402
from prefix_cache.service import app as app_module  # noqa: E402
from prefix_cache.service.settings import ServiceSettings  # noqa: E402
from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools, machine  # noqa: E402

MODEL = "demo-qwen3"  # the demo model folder's name
ANSWER = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 6000, "completion_tokens": 1, "total_tokens": 6001}}).encode()


class StdlibHandler(BaseHTTPRequestHandler):
    """``mlx_lm.server``'s way of answering: HTTP/1.1 keep-alive, the head then the body,
    each its own write, no TCP_NODELAY."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


async def asgi_upstream(scope: dict[str, Any], receive: Callable[..., Any],
                        send: Callable[..., Any]) -> None:
    """The same answer from uvicorn (which sets TCP_NODELAY)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    body = ANSWER if scope["method"] == "POST" else b"ok"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def on_uvicorn(app: Any) -> Iterator[str]:
    # proto IPPROTO_TCP, as uvicorn binds: asyncio sets TCP_NODELAY only on such sockets'
    # connections (a plain socket.socket() would add the very stall measured here).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def stdlib_upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StdlibHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def bare_relay(upstream: str) -> Callable[..., Any]:
    """The floor: an ASGI app that posts the body on with the sidecar's upstream client and
    answers with the upstream's bytes (no auth, parse, cache or metrics)."""
    clients: list[httpx.AsyncClient] = []

    async def app(scope: dict[str, Any], receive: Callable[..., Any],
                  send: Callable[..., Any]) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                clients.append(upstream_client_module.upstream_client(
                    httpx.Timeout(60), httpx.Limits(max_connections=10)))
                await send({"type": "lifespan.startup.complete"})
            await clients[0].aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        answer = await clients[0].post(upstream + "/v1/chat/completions",
                                       content=b"".join(chunks),
                                       headers={"content-type": "application/json"})
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer.content})

    return app


def httpx_defaults(timeout: httpx.Timeout, limits: httpx.Limits,
                   quickack: bool = True) -> httpx.AsyncClient:
    """The sidecar's upstream client before: httpx's defaults (no socket options)."""
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


CLIENTS: dict[str, Callable[..., httpx.AsyncClient]] = {
    "httpx defaults (before)": httpx_defaults,
    "NODELAY + QUICKACK (now)": upstream_client_module.upstream_client}


@contextmanager
def sidecar(upstream: str, client: str) -> Iterator[str]:
    """A sidecar (the demo model) in front of ``upstream``; its upstream client made by
    ``CLIENTS[client]``."""
    folder = demo_model_dir()
    app_module.upstream_client = CLIENTS[client]  # read by the app's lifespan, at start
    try:
        settings = ServiceSettings(model_dirs=[folder], upstream=[upstream], keys_file=None,
                                   models_file=None, redis_url=None)
        with on_uvicorn(app_module.create_app(settings)) as url:
            yield url
    finally:
        app_module.upstream_client = upstream_client_module.upstream_client


SERVERS: dict[str, Callable[..., Any]] = {
    "http.server": stdlib_upstream, "uvicorn": lambda: on_uvicorn(asgi_upstream),
    "sidecar": sidecar, "bare relay": lambda upstream: on_uvicorn(bare_relay(upstream))}


def _serve(conn: Any, name: str, args: tuple[Any, ...]) -> None:
    with SERVERS[name](*args) as url:
        conn.send(url)
        conn.recv()  # until told to stop


PIDS: dict[str, int] = {}  # a server apart's URL -> its process


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_hit(url: str, path: str, upstream: str, count: int) -> tuple[float, float]:
    """The CPU time one relayed hit costs the server at ``url`` and the upstream (each in its
    own process), over ``count`` hits in a row: what the load inflates least."""
    hit, headers = body(SYSTEM_PROMPT * 10), {"content-type": "application/json"}
    with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
        client.post(path, content=hit, headers=headers).raise_for_status()
        ours, theirs = cpu_seconds(PIDS[url]), cpu_seconds(PIDS[upstream])
        for _ in range(count):
            client.post(path, content=hit, headers=headers).raise_for_status()
        return ((cpu_seconds(PIDS[url]) - ours) / count,
                (cpu_seconds(PIDS[upstream]) - theirs) / count)


@contextmanager
def server(name: str, *args: Any, apart: bool = False) -> Iterator[str]:
    """``SERVERS[name]`` in this process, or (``apart``) in a process of its own."""
    if not apart:
        with SERVERS[name](*args) as url:
            yield url
        return
    here, there = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(there, name, args), daemon=True)
    process.start()
    try:
        if not here.poll(120):
            raise RuntimeError(f"{name} did not start")
        url = here.recv()
        PIDS[url] = process.pid
        yield url
    finally:
        here.send(None)
        process.join(15)
        if process.is_alive():
            process.terminate()


def body(system: str) -> bytes:
    tools = bench_tools(7)
    for tool in tools:
        tool["function"]["description"] += " " + "Details of the tool's contract. " * 70
    return json.dumps({"model": MODEL, "max_tokens": 1, "tools": tools, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "Go on."}]}).encode()


def timed(call: Callable[[], httpx.Response]) -> float:
    start = time.perf_counter()
    response = call()
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
    return elapsed


def measure(upstream: str, sidecars: dict[str, str], rounds: int,
            floor: str | None = None) -> dict[str, list[float]]:
    system = SYSTEM_PROMPT * 10
    hit = body(system)
    headers = {"content-type": "application/json"}
    clients = {name: httpx.Client(base_url=url, trust_env=False, timeout=60)
               for name, url in sidecars.items()}
    for client in clients.values():  # the static prefix resolved: every later one a hit
        timed(lambda c=client: c.post("/v1/chat/completions", content=hit, headers=headers))
    samples: dict[str, list[float]] = {}

    host, port = upstream.removeprefix("http://").split(":")

    def direct() -> httpx.Response:
        fresh = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            fresh.request("POST", "/v1/chat/completions", body=hit, headers=headers)
            answer = fresh.getresponse()
            return httpx.Response(answer.status, content=answer.read())
        finally:
            fresh.close()

    calls: dict[str, Callable[[], httpx.Response]] = {"direct (fresh connection)": direct}
    if floor is not None:
        bare = httpx.Client(base_url=floor, trust_env=False, timeout=60)
        clients["bare relay"] = bare
        calls["bare relay (uvicorn + the same upstream client)"] = (
            lambda: bare.post("/", content=hit, headers=headers))
    for name, client in sidecars_of(clients):
        calls[f"{name}: hit"] = (lambda c=client: c.post("/v1/chat/completions", content=hit,
                                                         headers=headers))
        calls[f"{name}: miss"] = (lambda c=client: c.post(
            "/v1/chat/completions", content=body(f"run {random.random()} " + system),
            headers=headers))
    for _ in range(rounds):
        order = list(calls.items())
        random.shuffle(order)
        for name, call in order:
            samples.setdefault(name, []).append(timed(call))
    for client in clients.values():
        client.close()
    return samples


def sidecars_of(clients: dict[str, httpx.Client]) -> list[tuple[str, httpx.Client]]:
    return [(name, client) for name, client in clients.items() if name != "bare relay"]


def leg(upstream: str, rounds: int) -> dict[str, float]:
    """The upstream leg alone (what the fix changes, apart from the hit's CPU work): the body
    posted on one kept-alive connection of each client, interleaved; medians."""
    hit = body(SYSTEM_PROMPT * 10)
    limits = httpx.Limits(max_connections=4)

    async def run() -> dict[str, float]:
        clients = {"httpx defaults (before)": httpx_defaults(httpx.Timeout(60), limits),
                   "NODELAY + QUICKACK (now)": upstream_client_module.upstream_client(
                       httpx.Timeout(60), limits)}
        samples: dict[str, list[float]] = {name: [] for name in clients}
        for _ in range(rounds):
            for name, client in random.sample(list(clients.items()), len(clients)):
                start = time.perf_counter()
                (await client.post(upstream + "/v1/chat/completions", content=hit)).read()
                samples[name].append(time.perf_counter() - start)
        for client in clients.values():
            await client.aclose()
        return {name: statistics.median(values[5:]) for name, values in samples.items()}

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--apart", action="store_true",
                        help="every server in its own process (default: all in this one)")
    args = parser.parse_args()
    apart = args.apart
    print(f"{machine()}; load {os.getloadavg()[0]:.2f}; body {len(body(SYSTEM_PROMPT * 10))} "
          f"bytes; {args.rounds} rounds; servers "
          f"{'each in its own process' if apart else 'all in this process'}\n")
    kinds = ("http.server", "uvicorn")
    cpu: dict[str, dict[str, tuple[float, float]]] = {}
    in_a_row = max(500, 3 * args.rounds)  # clock ticks are 10 ms: enough requests to read them
    print("The upstream leg alone (the sidecar's client to the upstream, kept alive):\n")
    print("| upstream | client | median |")
    print("|---|---|---|")
    for kind in kinds:
        with server(kind, apart=apart) as upstream:
            for name, median in leg(upstream, args.rounds).items():
                print(f"| {kind} | {name} | {median * 1e3:.2f} ms |")
    print("\nThrough the sidecar (a hit renders and tokenizes the prompt after its static "
          "prefix; a miss also the two probes):\n")
    print("| upstream | call | median | added to direct |")
    print("|---|---|---|---|")
    for kind in kinds:
        before_name, now_name = CLIENTS
        with server(kind, apart=apart) as upstream, \
                server("sidecar", upstream, before_name, apart=apart) as before, \
                server("sidecar", upstream, now_name, apart=apart) as now, \
                server("bare relay", upstream, apart=apart) as floor:
            samples = measure(upstream, {before_name: before, now_name: now}, args.rounds,
                              floor)
            if apart:
                cpu[kind] = {"sidecar, a hit": cpu_per_hit(now, "/v1/chat/completions", upstream,
                                                          in_a_row),
                             "bare relay": cpu_per_hit(floor, "/", upstream, in_a_row)}
        base = statistics.median(samples["direct (fresh connection)"])
        for name, values in samples.items():
            median = statistics.median(values)
            added = "" if name.startswith("direct") else f"{(median - base) * 1e3:+.2f} ms"
            print(f"| {kind} | {name} | {median * 1e3:.2f} ms | {added} |")
    if cpu:
        print(f"\nCPU time per relayed request ({in_a_row} in a row; the sidecar's "
              "upstream client NODELAY + QUICKACK):\n")
        print("| upstream | relay | relay's process | upstream's process |")
        print("|---|---|---|---|")
        for kind, rows in cpu.items():
            for name, (ours, theirs) in rows.items():
                print(f"| {kind} | {name} | {ours * 1e3:.2f} ms | {theirs * 1e3:.2f} ms |")
    print(f"\nload after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.set_event_loop(asyncio.new_event_loop())
    main()

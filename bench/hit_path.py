"""The hit at its limit, side by side in one run (loopback only, bounded):

1. in process: `StaticPrefixCache.resolve` on a memory hit (prompt ids given) against the
   uncached two-probe computation, 64 tools, the real Qwen3.5 tokenizer and template
   (`prefix_cache.testing.benchmark.run_case`, the same as `prefix-cache bench`);
2. through HTTP, one keep-alive client: `POST /v1/prefix/boundary` (a hit, without and with
   `prompt_ids` in the body) against `GET /healthz` of the same server, in a freshly shuffled
   order per round: the median each request adds;
3. throughput of one worker, several keep-alive clients: boundary hits per second against
   `/healthz` requests per second, in alternating slices.

    PYTHONPATH=$PWD python bench/hit_path.py [--seconds 20] [--clients 8] [--base REF] [--check-rate R]
        [--output docs/benchmarks-hit-path.table.md]

`prefix-cache serve` (demo model, memory store, one worker) runs as its own process; with
`--base REF` a second server runs the `prefix_cache` package of that commit (`git archive`)
beside it, and every HTTP measurement alternates between the two. Client and servers share the
machine's cores: the ratios, not the absolute figures, are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools, machine  # noqa: E402

TEMPLATE = ROOT.parent / "shared" / "chat_templates" / "Qwen3.5-4B.jinja"
TOOLS = 64


# -- servers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def extract(ref: str, into: Path) -> Path:
    """The packages of commit ``ref``, extracted into ``into`` (a PYTHONPATH for its server)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "prefix_cache",
                              "engine_adapter"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


@dataclass(frozen=True)
class Server:
    port: int
    pid: int

    def cpu_seconds(self) -> float:
        """CPU time of all the server's threads so far (scheduler statistics, nanoseconds):
        what a request costs the server, whatever else the shared machine runs meanwhile."""
        total = 0
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
                pass
        return total / 1e9


@contextmanager
def server(pythonpath: Path, log: Path, check_rate: float | None = None) -> Iterator[Server]:
    """``prefix-cache serve`` of the tree at ``pythonpath`` on a free port (``check_rate``: its
    sampled full tokenization checks, default the server's own)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    if check_rate is not None:
        env["PREFIX_CACHE_TOKENIZE_CHECK_RATE"] = str(check_rate)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "prefix_cache.cli", "serve", "--host",
                                 "127.0.0.1", "--port", str(port)], env=env, stdout=out,
                                # -m puts the working folder first on sys.path: the tree's own
                                stderr=subprocess.STDOUT, cwd=pythonpath)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(port) as c:
                    c.get("/healthz")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start: see {log}") from None
                time.sleep(0.2)
        yield Server(port, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- a minimal keep-alive HTTP/1.1 client (raw socket: its own cost stays small) --------------


def request_bytes(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def split_response(buffer: bytes) -> tuple[int, bytes, bytes] | None:
    """(status, body, rest) once ``buffer`` holds a whole response, else None."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buffer[:end].decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in head
                  if line.lower().startswith("content-length:"))
    start = end + 4
    if len(buffer) < start + length:
        return None
    return int(head[0].split()[1]), buffer[start:start + length], buffer[start + length:]


class Client:
    """One keep-alive connection, one request at a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, raw: bytes) -> bytes:
        self.sock.sendall(raw)
        while (done := split_response(self.buffer)) is None:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise OSError("the server closed the connection")
            self.buffer += chunk
        status, body, self.buffer = done
        if status != 200:
            raise SystemExit(f"HTTP {status}: {body[:300]!r}")
        return body

    def get(self, path: str) -> bytes:
        return self.send(request_bytes("GET", path))


# -- the requests ------------------------------------------------------------------------------


def boundary_bodies(port: int) -> dict[str, bytes]:
    """A 64-tool agent turn, without and with the prompt ids the server itself returns."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Fix the failing test in module_7.py."}]
    body = {"messages": messages, "tools": bench_tools(TOOLS)}
    raw = json.dumps(body).encode()
    with Client(port) as c:
        first = json.loads(c.send(request_bytes("POST", "/v1/prefix/boundary", json.dumps(
            {**body, "return_prompt_ids": True}).encode())))
    with_ids = json.dumps({**body, "prompt_ids": first["prompt_ids"]}).encode()
    return {"hit": raw, "hit with prompt_ids": with_ids}


def latency(servers: dict[str, Server], seconds: float) -> dict[str, dict[str, float]]:
    """Median ms per request kind and server (wall, at the client), and the server's mean CPU
    ms per request of each kind; kinds and servers interleaved."""
    calls = {}
    clients = {name: Client(s.port) for name, s in servers.items()}
    for name, s in servers.items():
        calls[(name, "healthz")] = request_bytes("GET", "/healthz")
        for kind, body in boundary_bodies(s.port).items():
            calls[(name, kind)] = request_bytes("POST", "/v1/prefix/boundary", body)
    for (name, _), raw in calls.items():  # warm: the miss, the first renders
        for _ in range(20):
            clients[name].send(raw)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in calls}
    cpu = dict.fromkeys(calls, 0.0)
    order = list(calls)
    rng = random.Random(0)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rng.shuffle(order)
        for key in order:
            used = servers[key[0]].cpu_seconds()
            started = time.perf_counter()
            clients[key[0]].send(calls[key])
            times[key].append(time.perf_counter() - started)
            cpu[key] += servers[key[0]].cpu_seconds() - used
    for c in clients.values():
        c.sock.close()
    out: dict[str, dict[str, float]] = {name: {} for name in servers}
    for (name, kind), ts in times.items():
        out[name][kind] = statistics.median(ts) * 1e3
        out[name][f"{kind} cpu"] = cpu[(name, kind)] / len(ts) * 1e3
        out[name]["n"] = len(ts)
    return out


async def _drive(port: int, raw: bytes, clients: int, seconds: float) -> int:
    """Requests completed by ``clients`` keep-alive connections in ``seconds``."""
    deadline = time.monotonic() + seconds
    done = 0

    async def one() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        buffer = b""
        try:
            while time.monotonic() < deadline:
                writer.write(raw)
                while (response := split_response(buffer)) is None:
                    chunk = await reader.read(1 << 16)
                    if not chunk:
                        raise OSError("the server closed the connection")
                    buffer += chunk
                status, body, buffer = response
                if status != 200:
                    raise SystemExit(f"HTTP {status}: {body[:300]!r}")
                done += 1
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return done


def throughput(servers: dict[str, Server], seconds: float, clients: int,
               slice_s: float = 1.0) -> dict[str, dict[str, float]]:
    """Requests per second of /healthz and of boundary hits (no prompt ids), per server, in
    alternating slices of ``slice_s``; and how busy the server was meanwhile (cores of CPU:
    near 1, its one event loop is what limits the rate, not the client)."""
    ports = {name: s.port for name, s in servers.items()}
    kinds = {name: {"healthz": request_bytes("GET", "/healthz"),
                    "hit": request_bytes("POST", "/v1/prefix/boundary",
                                         boundary_bodies(port)["hit"])}
             for name, port in ports.items()}
    counts = {(name, kind): 0 for name in ports for kind in ("healthz", "hit")}
    spent = dict.fromkeys(counts, 0.0)
    cpu = dict.fromkeys(counts, 0.0)
    order = list(counts)
    rng = random.Random(1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rng.shuffle(order)
        for name, kind in order:
            started, used = time.monotonic(), servers[name].cpu_seconds()
            counts[(name, kind)] += asyncio.run(_drive(ports[name], kinds[name][kind], clients,
                                                       slice_s))
            spent[(name, kind)] += time.monotonic() - started
            cpu[(name, kind)] += servers[name].cpu_seconds() - used
    out: dict[str, dict[str, float]] = {name: {} for name in ports}
    for (name, kind), n in counts.items():
        out[name][kind] = n / spent[(name, kind)]
        out[name][f"{kind} busy"] = cpu[(name, kind)] / spent[(name, kind)]
    return out


# -- in process --------------------------------------------------------------------------------


def in_process(requests: int) -> dict[str, float]:
    from prefix_cache.testing.benchmark import run_case
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    template = TEMPLATE.read_text() if TEMPLATE.is_file() else None
    if template is None:
        from prefix_cache.model_folders.demo import DEMO_TEMPLATE
        template = DEMO_TEMPLATE
    tokenizer = load_offline_tokenizer("qwen3.5")
    row = run_case(tokenizer, template, TOOLS, requests)
    out = {k: row[k] for k in ("uncached_ms", "hit_us", "speedup", "prompt_tokens",
                               "static_tokens")}
    return {**out, **hot_hits(tokenizer, template, requests)}


def hot_hits(tokenizer: Any, template: str, requests: int) -> dict[str, float]:
    """Hits back to back (no render between them), interleaved: the prompt ids given as a list
    of ints, as the uint32 array an engine holds, and that array with the tools frozen once
    (``FrozenTools``: an agent whose tool set is fixed). Medians in µs."""
    import numpy as np

    from prefix_cache import FrozenTools, StaticPrefixCache
    from prefix_cache.render.render import get_renderer

    tools = bench_tools(TOOLS)
    frozen = FrozenTools(tools)
    system = {"role": "system", "content": SYSTEM_PROMPT}
    renderer = get_renderer(tokenizer, template, tools)
    turns = []
    for i in range(20):
        messages = [system, {"role": "user", "content": f"Request {i}: fix module_{i}.py"}]
        ids = renderer.render_ids(messages, tools, {})
        array = np.asarray(ids, dtype=np.uint32)
        turns.append((messages, {"list": (tools, ids), "array": (tools, array),
                                 "frozen": (frozen, array)}))
    cache = StaticPrefixCache()
    times: dict[str, list[float]] = {"list": [], "array": [], "frozen": []}
    rng = random.Random(1)
    for n in range(requests + 20):
        messages, given = turns[n % len(turns)]
        for kind in rng.sample(list(times), len(times)):
            kind_tools, ids = given[kind]
            started = time.perf_counter()
            r = cache.resolve(tokenizer, messages, kind_tools, prompt_ids=ids,
                              chat_template=template)
            if n >= 20:  # the first round: misses, then the first hits
                assert r.hit
                times[kind].append(time.perf_counter() - started)
    return {f"hot_{kind}_us": statistics.median(ts) * 1e6 for kind, ts in times.items()}


# -- report ------------------------------------------------------------------------------------


def report(args: argparse.Namespace, inproc: dict[str, float] | None,
           lat: dict[str, dict[str, float]], rate: dict[str, dict[str, float]],
           loads: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    lines = [f"Machine: {machine()}; load average {loads[0][0]:.2f} at the start, "
             f"{loads[1][0]:.2f} at the end (shared with other work).",
             f"Command: `PYTHONPATH=$PWD python bench/hit_path.py --seconds {args.seconds:g} "
             f"--clients {args.clients}{' --base ' + args.base if args.base else ''}"
             f"{f' --check-rate {args.check_rate:g}' if args.check_rate is not None else ''}`", ""]
    if inproc is not None:
        lines += ["In process, 64 tools, Qwen3.5 tokenizer and template, prompt ids given "
                  f"({inproc['prompt_tokens']:.0f} prompt tokens, boundary "
                  f"{inproc['static_tokens']:.0f}), medians of {args.requests} requests:", "",
                  "| uncached two-probe | hit | hit speedup |", "|---|---:|---:|",
                  f"| {inproc['uncached_ms']:.2f} ms | {inproc['hit_us']:.1f} µs between "
                  f"uncached renders (`prefix-cache bench`'s) | **{inproc['speedup']:.0f}x** |"]
        for kind, what in (("list", "a list of ints"), ("array", "a uint32 numpy array"),
                           ("frozen", "a uint32 numpy array, tools frozen once (`FrozenTools`)")):
            hot = inproc[f"hot_{kind}_us"]
            lines.append(f"| | {hot:.1f} µs back to back, ids as {what} | "
                         f"**{inproc['uncached_ms'] * 1e3 / hot:.0f}x** |")
        lines.append("")
    lines += ["Through HTTP (`prefix-cache serve`, demo model, one worker), one keep-alive client, "
              "64 tools (a hit): the median at the client, and the server's CPU per request "
              "(all its threads, from /proc/PID/task/*/schedstat):", "",
              "| server | request | median | added over /healthz | server CPU | added CPU |",
              "|---|---|---:|---:|---:|---:|"]
    for name, m in lat.items():
        for kind in ("healthz", "hit", "hit with prompt_ids"):
            label = "GET /healthz" if kind == "healthz" else f"boundary {kind}"
            added = "" if kind == "healthz" else f"**{m[kind] - m['healthz']:.3f} ms**"
            added_cpu = "" if kind == "healthz" else f"{m[kind + ' cpu'] - m['healthz cpu']:.3f} ms"
            lines.append(f"| {name} | {label} | {m[kind]:.3f} ms | {added} | "
                         f"{m[kind + ' cpu']:.3f} ms | {added_cpu} |")
    lines.append(f"\n{lat[next(iter(lat))]['n']:.0f} requests of each kind per server.")
    lines += ["", f"Throughput of one worker, {args.clients} keep-alive clients, alternating "
              "1 s slices (server busy: cores of CPU its threads used meanwhile):", "",
              "| server | /healthz per s | boundary hits per s | hits / healthz | server busy |",
              "|---|---:|---:|---:|---:|"]
    for name, r in rate.items():
        lines.append(f"| {name} | {r['healthz']:.0f} | {r['hit']:.0f} | "
                     f"**{r['hit'] / r['healthz']:.2f}** | {r['healthz busy']:.2f} / "
                     f"{r['hit busy']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="for the latency and for the throughput part, each")
    parser.add_argument("--clients", type=int, default=8, help="for the throughput part")
    parser.add_argument("--requests", type=int, default=200, help="in-process requests")
    parser.add_argument("--base", help="also serve this commit's package, side by side")
    parser.add_argument("--check-rate", type=float, help="the servers' sampled full "
                        "tokenization checks (PREFIX_CACHE_TOKENIZE_CHECK_RATE; default theirs)")
    parser.add_argument("--no-in-process", action="store_true")
    parser.add_argument("--output", help="write the tables here too (Markdown)")
    args = parser.parse_args()
    start_load = os.getloadavg()
    inproc = None if args.no_in_process else in_process(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT}
        if args.base:
            trees[f"base {args.base}"] = extract(args.base, Path(tmp) / "base")
        with _servers(trees, Path(tmp), args.check_rate) as servers:
            lat = latency(servers, args.seconds)
            rate = throughput(servers, args.seconds, args.clients)
    table = report(args, inproc, lat, rate, (start_load, os.getloadavg()))
    print(table)
    if args.output:
        Path(args.output).write_text(table, encoding="utf-8")


@contextmanager
def _servers(trees: dict[str, Path], tmp: Path, check_rate: float | None
             ) -> Iterator[dict[str, Server]]:
    with ExitStack() as stack:
        yield {name: stack.enter_context(server(path, tmp / f"server{i}.log", check_rate))
               for i, (name, path) in enumerate(trees.items())}


if __name__ == "__main__":
    main()

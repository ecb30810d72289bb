"""What the request-level metrics and the dashboard's history cost a hit, side by side in one run:
this tree's `prefix-cache serve` against a base commit's (`--base REF`, `git archive`), both in
front of one local upstream that answers at once (a canned chat completion with its usage), so
what is measured is the sidecar's own work.

Per server, in a freshly shuffled order per round, one keep-alive client each:
- a chat completion whose static prefix hits (64 tools, the bench's system prompt), relayed
  to the upstream and back: every new metric is recorded on this path (the record, its
  labels, the usage read from the relayed answer, six families, the history);
- a boundary hit (`POST /v1/prefix/boundary`): the history's lookup tally only;
- `GET /healthz`: the floor.
The median wall time at the client, and the server's CPU time per request (its threads'
schedstat: what the request cost the server, whatever else the shared machine runs).

    PYTHONPATH=$PWD python bench/request_metrics.py --base main [--seconds 20]
        [--output docs/benchmarks-request-metrics.table.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hit_path import Client, extract, free_port, request_bytes, server  # noqa: E402

from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools, machine  # noqa: E402

ANSWER = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1200, "completion_tokens": 1, "total_tokens": 1201,
              "prompt_tokens_details": {"cached_tokens": 1100}}}).encode()


async def _upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive HTTP/1.1 upstream: every request gets the canned answer."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if length:
                await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: " + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def start_upstream() -> int:
    port = free_port()
    ready = threading.Event()

    def run() -> None:
        async def main() -> None:
            await asyncio.start_server(_upstream, "127.0.0.1", port)
            ready.set()
            await asyncio.Event().wait()
        asyncio.run(main())

    threading.Thread(target=run, daemon=True).start()
    ready.wait(10)
    return port


def calls() -> dict[str, bytes]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Fix the failing test in module_7.py."}]
    tools = bench_tools(64)
    chat = json.dumps({"model": "demo-qwen3", "messages": messages, "tools": tools,
                       "max_tokens": 1}).encode()
    boundary = json.dumps({"messages": messages, "tools": tools}).encode()
    return {"chat hit": request_bytes("POST", "/v1/chat/completions", chat),
            "boundary hit": request_bytes("POST", "/v1/prefix/boundary", boundary),
            "healthz": request_bytes("GET", "/healthz")}


def measure(servers: dict, seconds: float) -> dict[str, dict[str, float]]:
    kinds = calls()
    clients = {name: Client(s.port) for name, s in servers.items()}
    keys = [(name, kind) for name in servers for kind in kinds]
    for name, kind in keys:  # warm: the miss, the first renders, the upstream connection
        for _ in range(20):
            clients[name].send(kinds[kind])
    times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    cpu = dict.fromkeys(keys, 0.0)
    rng = random.Random(0)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rng.shuffle(keys)
        for name, kind in keys:
            used = servers[name].cpu_seconds()
            started = time.perf_counter()
            clients[name].send(kinds[kind])
            times[(name, kind)].append(time.perf_counter() - started)
            cpu[(name, kind)] += servers[name].cpu_seconds() - used
    out: dict[str, dict[str, float]] = {name: {} for name in servers}
    for (name, kind), ts in times.items():
        out[name][kind] = statistics.median(ts) * 1e3
        out[name][f"{kind} cpu"] = cpu[(name, kind)] / len(ts) * 1e3
        out[name]["n"] = len(ts)
    return out


def report(args: argparse.Namespace, found: dict[str, dict[str, float]],
           load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    names = list(found)
    this, base = names[0], names[-1]
    lines = [f"Machine: {machine()}; load average {load[0][0]:.1f} at the start, "
             f"{load[1][0]:.1f} at the end (a shared machine); {args.seconds:g} s, "
             f"{int(found[this]['n'])} requests of each kind per server.", "",
             "| request | " + " | ".join(f"{n}: median ms (server CPU ms)" for n in names)
             + " | this / base (median, CPU) |", "|---|" + "---|" * (len(names) + 1)]
    for kind in ("chat hit", "boundary hit", "healthz"):
        cells = [f"{found[n][kind]:.3f} ({found[n][kind + ' cpu']:.3f})" for n in names]
        ratio = (f"**{found[this][kind] / found[base][kind]:.2f}**, "
                 f"**{found[this][kind + ' cpu'] / found[base][kind + ' cpu']:.2f}**")
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--output", help="write the table here too (Markdown)")
    args = parser.parse_args()
    start_load = os.getloadavg()
    os.environ["PREFIX_CACHE_UPSTREAM"] = f"http://127.0.0.1:{start_upstream()}"
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT, f"base {args.base}": extract(args.base, Path(tmp) / "base")}
        with server(trees["this tree"], Path(tmp) / "this.log") as a, \
                server(trees[f"base {args.base}"], Path(tmp) / "base.log") as b:
            found = measure({"this tree": a, f"base {args.base}": b}, args.seconds)
    table = report(args, found, (start_load, os.getloadavg()))
    print(table)
    if args.output:
        Path(args.output).write_text(table, encoding="utf-8")


if __name__ == "__main__":
    main()

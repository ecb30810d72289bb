"""Routing benchmark: N ``serve-engine`` replicas behind one sidecar, ``round_robin`` against
``prefix_affinity``, side by side in one run.

    bash bench/routing.sh [--agents 32] [--turns 6] [--clients 8]
                                            [--replicas 4] [--kv-prefixes 12] [--update-docs]

Per policy, fresh processes on loopback: ``--replicas`` engines (``prefix-cache serve-engine``,
the tiny random-weights Qwen3 model, ``--trust-namespace``) and one sidecar (``prefix-cache
serve --upstream ... x N``, kind specprefill, the policy from ``PREFIX_CACHE_UPSTREAM_ROUTING``).
``--agents`` agents, each with its own static prefix (its own system prompt and 64 tools), hold
a conversation of ``--turns`` turns: turn t of every agent is sent, in a shuffled order (the same
for both policies), by ``--clients`` concurrent clients, streaming, before turn t+1 starts.

Measured from the engines' own counters (``GET /metrics`` of each engine): the static-prefix KV
lookups (hit, miss), the prompt tokens computed; from the client: time to first token. Each
engine's static-prefix store holds ``--kv-prefixes`` agents' prefixes (1.5x an even share by
default: the case a pool is for, where every agent's prefix does not fit in every replica; 0:
the engine's default, 1 GiB) and its conversation store is off, so every restored prefix is the
static-prefix store's and the hit rate is exactly its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import free_port, update_docs  # noqa: E402
from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools, cpu_name  # noqa: E402

POLICIES = ("round_robin", "prefix_affinity")
DOCS = ROOT / "docs" / "benchmarks.md"
MARK_START, MARK_END = "<!-- bench:routing:start -->", "<!-- bench:routing:end -->"
MODEL = "tiny-qwen3"
STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 300.0
BLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def environment(home: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PREFIX_CACHE_HOME": str(home),
           "PREFIX_CACHE_LOG_LEVEL": "warning"}
    if not env.get("LD_PRELOAD") and Path(BLAS).is_file():
        env["LD_PRELOAD"] = BLAS  # mlx's CPU matmuls, ~36x faster than the reference BLAS
    return env


def wait_ready(url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server exited before {url} was ready")
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not become ready")


@contextmanager
def servers(model: Path, policy: str, args: argparse.Namespace, home: Path,
            kv_bytes: int | None) -> Iterator[tuple[str, list[str]]]:
    """The engines and the sidecar for one policy: (sidecar URL, engine URLs)."""
    env = environment(home)
    options = ["--engine-option", "conversation_bytes=0"]
    if kv_bytes:
        options += ["--engine-option", f"kv_bytes={kv_bytes}"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        engines = []
        for _ in range(args.replicas):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "prefix_cache.cli", "serve-engine", "--model", str(model),
                 "--port", str(port), "--trust-namespace", *options], env=env, cwd=ROOT,
                stdout=subprocess.DEVNULL))   # its access log
            engines.append(f"http://127.0.0.1:{port}")
        for url in engines:
            wait_ready(f"{url}/health", procs)
        port = free_port()
        upstreams = [flag for url in engines for flag in ("--upstream", f"{url}/v1")]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "prefix_cache.cli", "serve", "--port", str(port),
             "--model", str(model), *upstreams],
            env={**env, "PREFIX_CACHE_UPSTREAM_KIND": "specprefill",
                 "PREFIX_CACHE_UPSTREAM_ROUTING": policy,
                 "PREFIX_CACHE_TENANT_MAX_CONCURRENCY": str(args.clients)}, cwd=ROOT))
        sidecar = f"http://127.0.0.1:{port}"
        wait_ready(f"{sidecar}/readyz", procs)
        yield sidecar, engines
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def system_message(agent: int) -> dict[str, str]:
    return {"role": "system", "content": f"You are agent {agent} of the fleet. {SYSTEM_PROMPT}"}


async def turn(client: httpx.AsyncClient, url: str, history: list[dict[str, Any]],
               tools: list[dict[str, Any]], agent: int, t: int) -> float:
    """One streamed turn; its time to first token (the first event with a token in it). The
    answer joins the history."""
    history.append({"role": "user", "content": f"Turn {t}: check module_{agent}_{t}.py."})
    body = {"model": MODEL, "messages": history, "tools": tools, "stream": True,
            "max_tokens": 8, "temperature": 0}
    started = time.perf_counter()
    first: float | None = None
    text = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                # The first token, not the role-only event a server sends before prefilling.
                if first is None and (delta.get("content") or delta.get("tool_calls")
                                      or choice.get("finish_reason")):
                    first = time.perf_counter() - started
                text.append(delta.get("content") or "")
    history.append({"role": "assistant", "content": "".join(text) or "ok"})
    return first if first is not None else time.perf_counter() - started


async def workload(url: str, args: argparse.Namespace) -> list[float]:
    """Every agent's turns, turn by turn, in a shuffled order; the TTFTs."""
    tools = bench_tools(args.tools)
    histories = {a: [system_message(a)] for a in range(args.agents)}
    rng = random.Random(args.seed)
    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S,
                                 limits=limits) as client:
        for t in range(args.turns):
            order = list(range(args.agents))
            rng.shuffle(order)
            queue: asyncio.Queue[int] = asyncio.Queue()
            for agent in order:
                queue.put_nowait(agent)

            async def worker(t: int = t, queue: asyncio.Queue[int] = queue) -> None:
                while not queue.empty():
                    agent = queue.get_nowait()
                    ttfts.append(await turn(client, url, histories[agent], tools, agent, t))

            await asyncio.gather(*(worker() for _ in range(args.clients)))
            print(f"  turn {t + 1}/{args.turns} done", file=sys.stderr, flush=True)
    return ttfts


SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} ([0-9.e+-]+)$')


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def engine_counters(url: str) -> dict[str, float]:
    counts = {"requests": 0.0, "hit": 0.0, "miss": 0.0, "computed": 0.0, "reused": 0.0}
    for name, labels, value in scrape(url):
        if name == "prefix_cache_engine_requests_total":
            counts["requests"] += value
        elif name == "prefix_cache_engine_kv_lookups_total" and labels["store"] == "static":
            counts[labels["result"]] += value
        elif name == "prefix_cache_engine_prompt_tokens_total":
            counts[labels["kind"]] += value
    return counts


def routing_choices(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in scrape(url):
        if name == "prefix_cache_upstream_requests_total":
            out[labels["choice"]] = out.get(labels["choice"], 0.0) + value
    return {k: v for k, v in out.items() if v}


def kv_budget(model: Path, args: argparse.Namespace, tokens: int) -> int | None:
    """Bytes of the static-prefix store holding ``--kv-prefixes`` prefixes of ``tokens``."""
    if not args.kv_prefixes:
        return None
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return int(args.kv_prefixes * tokens * per_token * 1.05)  # 5%: entry overheads


def static_tokens(model: Path, args: argparse.Namespace) -> int:
    from prefix_cache import StaticPrefixCache
    from prefix_cache.model_folders.model_dir import load_tokenizer

    tokenizer = load_tokenizer(model)
    messages = [system_message(0), {"role": "user", "content": "Turn 0."}]
    return StaticPrefixCache().resolve(tokenizer, messages,
                                       bench_tools(args.tools)).specprefill_system_end


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine_adapter.testing.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="prefix-cache-bench-routing-"))
    model = make_tiny_model(work / MODEL)
    tokens = static_tokens(model, args)
    kv_bytes = kv_budget(model, args, tokens)
    report: dict[str, Any] = {"static_tokens": tokens, "kv_bytes": kv_bytes, "policies": {}}
    for policy in POLICIES:
        print(f"{policy}:", file=sys.stderr, flush=True)
        with servers(model, policy, args, work / "home", kv_bytes) as (sidecar, engines):
            started = time.perf_counter()
            ttfts = asyncio.run(workload(sidecar, args))
            wall = time.perf_counter() - started
            per_engine = [engine_counters(url) for url in engines]
            choices = routing_choices(sidecar)
        total = {k: sum(e[k] for e in per_engine) for k in per_engine[0]}
        later = total["requests"] - args.agents   # turns after each agent's first
        report["policies"][policy] = {
            "requests": int(total["requests"]), "hits": int(total["hit"]),
            "misses": int(total["miss"]),
            "hit_rate_after_first": (total["hit"] / later) if later else 0.0,
            "prefill_tokens": int(total["computed"]), "reused_tokens": int(total["reused"]),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": pct(ttfts, 0.99),
            "wall_s": wall, "per_replica_requests": [int(e["requests"]) for e in per_engine],
            "choices": choices,
        }
        print(json.dumps(report["policies"][policy]), file=sys.stderr, flush=True)
    return report


def seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 10 else f"{value:.1f} s"


def table(report: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    rr, pa = (report["policies"][p] for p in POLICIES)
    kv = (f"{report['kv_bytes'] / 2**20:.0f} MiB ({args.kv_prefixes} prefixes)"
          if report["kv_bytes"] else "the engine's default (1 GiB)")
    lines = [
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, shared with other builds while it ran "
        f"(read the ratios, not the milliseconds); {args.replicas} `serve-engine` replicas (tiny "
        f"random-weights Qwen3, float32, OpenBLAS) + the sidecar + the client on those cores. "
        f"{args.agents} agents x {args.turns} turns, {args.clients} clients, {args.tools} tools "
        f"per agent (static prefix {report['static_tokens']} tokens); static-prefix store per "
        f"engine: {kv}; conversation store off. Command: `{command}`",
        "",
        "| policy | static-prefix KV hit rate (turns after the first) | misses | prefill tokens "
        "| TTFT p50 | TTFT p99 | requests per replica | routing choices |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for policy in POLICIES:
        r = report["policies"][policy]
        choices = ", ".join(f"{k} {int(v)}" for k, v in sorted(r["choices"].items()))
        lines.append(
            f"| {policy} | {r['hit_rate_after_first']:.1%} | {r['misses']} | "
            f"{r['prefill_tokens']:,} | {seconds(r['ttft_p50_s'])} | "
            f"{seconds(r['ttft_p99_s'])} | {r['per_replica_requests']} | {choices} |")
    ratio = (pa["hit_rate_after_first"] / rr["hit_rate_after_first"]
             if rr["hit_rate_after_first"] else float("inf"))
    lines += ["", f"prefix_affinity / round_robin: hit rate {ratio:.2f}x, prefill tokens "
              f"{pa['prefill_tokens'] / max(rr['prefill_tokens'], 1):.2f}x, TTFT p50 "
              f"{pa['ttft_p50_s'] / rr['ttft_p50_s']:.2f}x, p99 "
              f"{pa['ttft_p99_s'] / rr['ttft_p99_s']:.2f}x."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--tools", type=int, default=64)
    parser.add_argument("--kv-prefixes", type=int, default=12,
                        help="static prefixes each engine's store holds (0: engine default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--update-docs", action="store_true",
                        help=f"write the table into {DOCS.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    report = run(args)
    text = table(report, args, command_line("bash bench/routing.sh", argv))
    publish(text, report, args, MARK_START, MARK_END)
    return 0


def command_line(program: str, argv: list[str] | None) -> str:
    """The command that reproduces this run, as the docs show it (without --update-docs)."""
    given = argv if argv is not None else sys.argv[1:]
    return " ".join([program, *(a for a in given if a != "--update-docs")])


def publish(text: str, report: dict[str, Any], args: argparse.Namespace, start: str,
            end: str) -> None:
    """Print the table; write the raw figures (--json) and the docs' block (--update-docs)."""
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.update_docs:
        update_docs(text, start, end, DOCS)


if __name__ == "__main__":
    raise SystemExit(main())

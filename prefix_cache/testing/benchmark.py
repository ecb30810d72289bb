"""`prefix-cache bench`: cached hit vs uncached two-probe vs naive subtraction, side by side.

For each tool count, the same requests (a fixed system prompt and tools, a different user turn
each time, prompt ids given as an engine would) are timed by all methods in a shuffled
order within one loop, so machine noise lands on all of them alike; medians and ratios are
reported, never absolute thresholds.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from ..cache import boundary
from ..cache.cache import StaticPrefixCache
from ..render.render import get_renderer

SYSTEM_PROMPT = (
    "You are a senior software engineering agent working inside a monorepo. Follow the "
    "repository conventions, keep changes minimal, run the tests after every edit, and explain "
    "each decision briefly. Never push to main directly; open a pull request instead. "
) * 4


def bench_tools(n: int) -> list[dict[str, Any]]:
    """n realistic tool schemas (names, descriptions, typed parameters)."""
    return [
        {
            "type": "function",
            "function": {
                "name": f"workspace_tool_{i}",
                "description": f"Tool {i}: operates on files, processes or the network of the "
                               "workspace and returns a JSON result describing what happened.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Path relative to the repo root."},
                        "pattern": {"type": "string", "description": "Glob or regex to match."},
                        "limit": {"type": "integer", "description": "Maximum items.", "default": 50},
                        "dry_run": {"type": "boolean", "description": "Report without changing."},
                    },
                    "required": ["path"],
                },
            },
        }
        for i in range(n)
    ]


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The machine a benchmark ran on, for its results table."""
    import os

    import transformers

    return (f"{cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, transformers {transformers.__version__}")


def run_case(tokenizer: Any, template: str, n_tools: int, n_requests: int,
             redis_url: str | None = None) -> dict[str, Any]:
    """Time the methods over ``n_requests`` requests of one agent with ``n_tools`` tools.

    With ``redis_url``, two more: a hit served by Redis itself (no memory tier) and a hit served
    by the memory tier of a tiered store, plus the bytes Redis spends on the entry.
    """
    tools = bench_tools(n_tools) or None
    system = {"role": "system", "content": SYSTEM_PROMPT}
    renderer = get_renderer(tokenizer, template, tools)
    requests = []
    for i in range(n_requests):
        messages = [system, {"role": "user", "content": f"Request {i}: fix the failing test in module_{i}.py"}]
        requests.append((messages, renderer.render_ids(messages, tools, {})))
    cache = StaticPrefixCache()
    cache.resolve(tokenizer, requests[0][0], tools, prompt_ids=requests[0][1], chat_template=template)

    def uncached(messages: list[dict[str, Any]], tools: Any, prompt: list[int]) -> int:
        static = messages[:1]
        ids = boundary.static_prefix_ids(lambda c: renderer.render_ids(c, tools, {}), static)
        return boundary.system_end(prompt, ids)

    def hit(messages: list[dict[str, Any]], tools: Any, prompt: list[int]) -> int:
        r = cache.resolve(tokenizer, messages, tools, prompt_ids=prompt, chat_template=template)
        assert r.hit
        return r.specprefill_system_end

    def naive(messages: list[dict[str, Any]], tools: Any, prompt: list[int]) -> int:
        rest = renderer.render_ids(messages[1:], tools, {})
        return len(prompt) - len(rest)

    methods: dict[str, Callable[..., int]] = {"uncached": uncached, "hit": hit, "naive": naive}
    extra: dict[str, Any] = {}
    if redis_url:
        from ..store.memory import MemoryStore
        from ..store.redis import RedisStore
        from ..store.tiered import TieredStore

        redis_store = RedisStore(redis_url, timeout_seconds=1.0)
        redis_store.purge("spc:*")
        remote = StaticPrefixCache(redis_store)
        tiered = StaticPrefixCache(TieredStore(MemoryStore(), RedisStore(redis_url, timeout_seconds=1.0),
                                               local_ttl_seconds=3600))
        for c in (remote, tiered):
            warm = c.resolve(tokenizer, requests[0][0], tools, prompt_ids=requests[0][1], chat_template=template)
        extra["redis_entry_bytes"] = redis_store.memory_usage(warm.key)
        extra["value_bytes"] = len(redis_store.get(warm.key) or b"")

        def via(c: StaticPrefixCache) -> Callable[..., int]:
            def run(messages: list[dict[str, Any]], tools: Any, prompt: list[int]) -> int:
                r = c.resolve(tokenizer, messages, tools, prompt_ids=prompt, chat_template=template)
                assert r.hit
                return r.specprefill_system_end
            return run

        methods["redis_hit"] = via(remote)
        methods["tiered_hit"] = via(tiered)
    times: dict[str, list[float]] = {name: [] for name in methods}
    answers: dict[str, set[int]] = {name: set() for name in methods}
    order = list(methods)
    rng = random.Random(n_tools)
    for messages, prompt in requests:
        raw = orjson.dumps({"messages": messages, "tools": tools, "prompt_ids": prompt})
        # A fresh random order per request: each method follows each other one equally often,
        # so no method always inherits the cache state a particular neighbour leaves behind.
        rng.shuffle(order)
        for name in order:
            # Each call gets its own freshly parsed request, as a server would hand it over.
            body = orjson.loads(raw)
            method = methods[name]
            start = time.perf_counter()
            answer = method(body["messages"], body["tools"], body["prompt_ids"])
            seconds = time.perf_counter() - start
            times[name].append(seconds)
            answers[name].add(answer)
    for name in methods:
        if name.endswith("hit"):
            assert answers[name] == answers["uncached"], (name, answers[name], answers["uncached"])
    med = {name: statistics.median(ts) for name, ts in times.items()}
    if redis_url:
        extra.update(redis_hit_us=med["redis_hit"] * 1e6, tiered_hit_us=med["tiered_hit"] * 1e6,
                     redis_speedup=med["uncached"] / med["redis_hit"],
                     tiered_speedup=med["uncached"] / med["tiered_hit"])
    return {**extra,
        "tools": n_tools,
        "static_tokens": next(iter(answers["uncached"])),
        "prompt_tokens": len(requests[0][1]),
        "uncached_ms": med["uncached"] * 1e3,
        "hit_us": med["hit"] * 1e6,
        "speedup": med["uncached"] / med["hit"],
        "naive_ms": med["naive"] * 1e3,
        "naive_boundary": sorted(answers["naive"]),
        "requests": n_requests,
    }


def _markdown(header: str, columns: str, cells: list[str]) -> str:
    """``header``, then a table of right-aligned ``columns`` (``a | b``), one row per cell line."""
    align = "|" + "---:|" * (columns.count("|") + 1)
    return "\n".join([header, "", f"| {columns} |", align, *cells]) + "\n"


def format_table(rows: list[dict[str, Any]], header: str) -> str:
    columns = ("tools | boundary (tokens) | naive boundary | uncached two-probe (median) | "
               "naive subtraction (median) | cached hit (median) | hit speedup vs uncached")
    cells = [
        f"| {r['tools']} | {r['static_tokens']} | "
        f"{','.join(str(v) for v in r['naive_boundary'][:3])} | {r['uncached_ms']:.2f} ms | "
        f"{r['naive_ms']:.2f} ms | {r['hit_us']:.1f} µs | **{r['speedup']:.0f}x** |"
        for r in rows]
    return _markdown(header, columns, cells)


def format_redis_table(rows: list[dict[str, Any]], header: str) -> str:
    columns = ("tools | boundary (tokens) | uncached two-probe | Redis hit | speedup | "
               "tiered (memory) hit | speedup | entry value | Redis MEMORY USAGE | "
               "bytes per static token")
    cells = [
        f"| {r['tools']} | {r['static_tokens']} | {r['uncached_ms']:.2f} ms | "
        f"{r['redis_hit_us']:.1f} µs | **{r['redis_speedup']:.0f}x** | "
        f"{r['tiered_hit_us']:.1f} µs | **{r['tiered_speedup']:.0f}x** | {r['value_bytes']} B | "
        f"{r['redis_entry_bytes']} B | "
        f"{r['redis_entry_bytes'] / max(r['static_tokens'], 1):.2f} |"
        for r in rows]
    return _markdown(header, columns, cells)


def run_benchmark(args: argparse.Namespace) -> int:
    from ..model_folders.demo import DEMO_TEMPLATE
    from .offline_tokenizers import load_offline_tokenizer

    tokenizer = load_offline_tokenizer(args.tokenizer)
    if args.chat_template:
        template = Path(args.chat_template).read_text(encoding="utf-8")
        template_name = Path(args.chat_template).name
    else:
        template, template_name = DEMO_TEMPLATE, "the demo Qwen3-style template"
    counts = [int(x) for x in args.tools.split(",") if x.strip()]
    rows = []
    for n in counts:
        row = run_case(tokenizer, template, n, args.requests_per_case, args.redis)
        rows.append(row)
        if args.redis:
            print(f"  redis_hit={row['redis_hit_us']:.1f} us ({row['redis_speedup']:.0f}x) "
                  f"tiered_hit={row['tiered_hit_us']:.1f} us entry={row['redis_entry_bytes']} B", flush=True)
        print(f"tools={n:3d} boundary={row['static_tokens']:6d} uncached={row['uncached_ms']:8.2f} ms "
              f"hit={row['hit_us']:8.1f} us speedup={row['speedup']:7.0f}x naive={row['naive_ms']:.2f} ms "
              f"naive_boundary={row['naive_boundary'][:3]}", flush=True)
    header = (
        f"Tokenizer `{args.tokenizer}` (real, offline), template {template_name}, "
        f"{args.requests_per_case} requests per row, medians. Machine: {machine()}.\n"
        f"Command: `prefix-cache bench --tokenizer {args.tokenizer}"
        f"{' --chat-template ' + args.chat_template if args.chat_template else ''}"
        f" --tools {args.tools} --requests-per-case {args.requests_per_case}`"
    )
    table = format_table(rows, header)
    if args.redis:
        table += "\n" + format_redis_table(rows, "Same run, the shared store: a hit served by Redis "
                                           "(loopback, no memory tier) and by the tiered store's memory tier.")
    print(table)
    if args.output:
        Path(args.output).write_text(table, encoding="utf-8")
    return 0

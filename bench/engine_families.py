"""Engine benchmark, model families: the second turn's time to first token against the first's,
per family, on a 64-tool agent (its static prefix is thousands of tokens).

    bash bench/engine.sh --families [--tools 64,100] [--update-docs]

Per family (gemma3_text, gpt_oss, qwen3_next, qwen3_5, qwen3_moe; tiny random-weights models,
float32, real Qwen3 vocabulary), side by side in one run:

  turn 1        MLXEngine, cold: nothing stored in its namespace
  turn 2, ours  MLXEngine: turn 1's prompt restored from the conversation store (or the static
                prefix from the static store), the rest computed
  turn 2, none  MLXEngine without any KV reuse (static and conversation stores off)
  turn 2, (a)   mlx_lm.server with its own prompt cache, after it served turn 1

Turn 2 is run ``--reps`` times, each on a fresh namespace whose turn 1 was just run cold;
medians are reported. No SpecPrefill (no draft): the rows measure reuse alone.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from engine import conversation, engine_first, server_ttft, start_server

SHAPE = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 768}
MARK_START, MARK_END = "<!-- bench:families:start -->", "<!-- bench:families:end -->"


def measure_family(arch: str, root: Path, tools_counts: list[int], reps: int,
                   log: Any) -> list[dict[str, Any]]:
    """One row per tools count: median TTFTs of turn 1 and the three turn-2 variants."""
    from mlx_lm import load

    from engine_adapter.mlx_engine import MLXEngine
    from engine_adapter.testing.tiny_model import tiny_model_folder
    from prefix_cache import StaticPrefixCache
    from prefix_cache.render.render import get_renderer, unwrap_tokenizer
    from prefix_cache.testing.benchmark import bench_tools

    folder = tiny_model_folder(root / f"family-{arch}", arch, **SHAPE)
    model, wrapper = load(str(folder))[:2]
    tok = unwrap_tokenizer(wrapper)
    renderer = get_renderer(tok)
    cache = StaticPrefixCache()
    ours = MLXEngine(model)
    none = MLXEngine(model, reuse_static_kv=False, reuse_conversation_kv=False)
    server, url = start_server(folder)
    rows = []
    try:
        engine_first(none, renderer.render_ids(conversation("warm-up")[0], [], {})[:64], 0, "w")
        for n_tools in tools_counts:
            tools = bench_tools(n_tools)
            times: dict[str, list[float]] = {"turn1": [], "ours": [], "none": [], "server": []}
            info = None
            for rep in range(reps):
                first, second = conversation(f"Now fix the worker's retries (attempt {rep}).")
                first[1] = {**first[1], "content": f"{first[1]['content']} (session {rep})"}
                second[1] = first[1]
                ns = f"{arch}-{n_tools}-{rep}"
                r1 = cache.resolve(tok, first, tools, namespace=ns)
                r2 = cache.resolve(tok, second, tools, namespace=ns)
                t1, _, _ = engine_first(ours, r1.prompt_ids, r1.specprefill_system_end, ns)
                t2, _, info = engine_first(ours, r2.prompt_ids, r2.specprefill_system_end, ns)
                tn, _, _ = engine_first(none, r2.prompt_ids, r2.specprefill_system_end, ns)
                server_ttft(url, first, tools)
                ts, _ = server_ttft(url, second, tools)
                for key, t in (("turn1", t1), ("ours", t2), ("none", tn), ("server", ts)):
                    times[key].append(t)
                log(arch, n_tools, rep, {k: round(v[-1], 3) for k, v in times.items()})
            assert info is not None
            rows.append({"arch": arch, "tools": n_tools, "prompt": info.prompt_tokens,
                         "static": info.static_tokens, "reused": info.reused_tokens,
                         "conversation": info.conversation_tokens,
                         **{k: statistics.median(v) for k, v in times.items()}})
    finally:
        server.terminate()
        server.wait(timeout=30)
        ours.close()
        none.close()
    return rows


def run_families(args: argparse.Namespace) -> list[dict[str, Any]]:
    from engine_adapter.testing.tiny_model import FAMILIES

    log = print if args.verbose else (lambda *a, **k: None)
    tools = [int(n) for n in args.tools.split(",")]
    return [row for arch in FAMILIES
            for row in measure_family(arch, Path(args.models_dir), tools, args.reps_short, log)]


def families_table(rows: list[dict[str, Any]], machine: str, command: str) -> str:
    lines = [
        f"Machine: {machine}; shared with other engineers' builds while it ran.",
        f"Command: `{command}`.",
        f"Models: {SHAPE} of each family (the hybrids: two layers of each kind, full and sliding-window "
        "with a 32-token window, or full and gated DeltaNet; the MoE ones 4 experts, 2 "
        "active), float32, random weights, real Qwen3 vocabulary. Medians; TTFT in ms.",
        "",
        "| family | tools | prompt / static tokens | turn 1 (cold) | turn 2, reused | "
        "turn 1 / turn 2 | turn 2, no reuse | turn 2, mlx_lm.server | what turn 2 restored |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        what = (f"{r['conversation']} tokens of turn 1 (conversation store)" if r["conversation"]
                else f"{r['reused']} static tokens" if r["reused"] else "nothing")
        lines.append(
            f"| {r['arch']} | {r['tools']} | {r['prompt']} / {r['static']} | "
            f"{r['turn1'] * 1000:.0f} | {r['ours'] * 1000:.0f} | {r['turn1'] / r['ours']:.1f}x | "
            f"{r['none'] * 1000:.0f} | {r['server'] * 1000:.0f} | {what} |")
    return "\n".join(lines)

"""Engine benchmark: time to first token and next-token KL divergence from a dense prefill, on
the second turn of a 64-tool agent, short and long (~8k-token document) user turns, and the
follow-up turn after the long one (a short question on the document).

    bash bench/engine.sh [--update-docs]      (preloads OpenBLAS, then runs this file)

Side by side in one run, same prompts, same tiny random-weights target (float32) and a draft
about 1/20 of its size (same Qwen3 vocabulary):

  (a) mlx_lm.server serving the target: dense prefill with its own prompt cache (it saw turn 1)
  (b) SpecPrefill over the whole prompt (no boundary, so nothing to reuse)
  (c) SpecPrefill with the naive boundary (full prompt minus a render without system messages)
      (b) and (c) run on an engine without the conversation store, so each request is exactly
      what its name says (with it, they would restore their own earlier, sparse, prompts)
  (d) our cached boundary: static prefix dense and reused from the KV store, SpecPrefill on the
      rest (dense when the rest is under the threshold; a dense turn then restores, from the
      engine's conversation store, the longest prefix it shares with an earlier prompt of its
      namespace: the previous turn, or an earlier run's second turn)
  (e) in-process dense prefill without any reuse: the reference distribution for the KL column

(b)-(e) run in this process on ``MLXEngine`` with prompt ids given; their TTFT includes what the
client side spends to get those ids and that boundary (prompt render, the naive second render,
or the cache lookup), while (a) renders inside the server and is reached over HTTP. SpecPrefill
runs with its defaults (keep 20%, chunks of 32, 512-token tail, 8 lookahead steps, pool 13,
threshold 8192 tokens after the boundary).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import servers  # noqa: E402
from servers import free_port  # noqa: E402,F401 (bench/routing.py imports it from here)

TARGET = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 768}
DRAFT = {"hidden": 64, "layers": 2, "heads": 1, "kv_heads": 1, "intermediate": 320}
N_TOOLS = 64
DOCS = ROOT / "docs" / "engine.md"
MARK_START, MARK_END = "<!-- bench:engine:start -->", "<!-- bench:engine:end -->"
WORDS = ("the configuration file lists every service with its port, owner and retry policy; "
         "deployments roll out region by region and each step waits for health checks before "
         "traffic moves; logs are kept for thirty days and metrics for a year").split()


def non_embedding_params(shape: dict[str, int]) -> int:
    h, heads, kv = shape["hidden"], shape["heads"], shape["kv_heads"]
    head_dim = h // heads
    attention = 2 * h * h + 2 * h * kv * head_dim
    return shape["layers"] * (attention + 3 * h * shape["intermediate"])


def machine() -> str:
    from prefix_cache.testing.benchmark import cpu_name

    cpu = cpu_name()
    import mlx.core as mx
    import mlx_lm

    blas = os.environ.get("LD_PRELOAD", "") or "none (mlx's own BLAS)"
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, mlx {getattr(mx, '__version__', '?')} (cpu), "
            f"mlx-lm {getattr(mlx_lm, '__version__', '?')}, LD_PRELOAD={blas}")


# -- the workload ----------------------------------------------------------------------------

def document(tok: Any, n_tokens: int, seed: int) -> str:
    """About ``n_tokens`` tokens of pasted text, different for each seed."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < n_tokens:  # a word is about a token here; trimmed below
        sentence = rng.sample(WORDS, k=12)
        words.extend(sentence + [f"(section {len(words)})."])
    text = " ".join(words)
    ids = tok.encode(text, add_special_tokens=False)[:n_tokens]
    return tok.decode(ids)


def conversation(user_turn: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(turn 1, turn 2) messages of one agent session."""
    from prefix_cache.testing.benchmark import SYSTEM_PROMPT

    first: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
             {"role": "user", "content": "Find the service configuration and tell me which "
                                         "services have no retry policy."}]
    second: list[dict[str, Any]] = first + [
        {"role": "assistant", "content": "Let me read the configuration first.",
         "tool_calls": [{"type": "function", "id": "call_1", "function": {
             "name": "workspace_tool_3", "arguments": '{"path": "deploy/services.yaml"}'}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": "services: [api (retries: 3), worker (retries: none), cron (retries: 1)]"},
        {"role": "user", "content": user_turn},
    ]
    return first, second


# -- the anchor: mlx_lm.server -----------------------------------------------------------------

def start_server(model_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """mlx_lm.server on ``model_dir``: (its process, its URL)."""
    server = servers.start_server("mlx_lm.server", servers.mlx_lm_argv(model_dir))
    return server.proc, server.url


def server_ttft(url: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> tuple[float, int]:
    """Seconds to the first streamed event, and the prompt length the server reports."""
    streamed = servers.stream_chat(url, {"model": "default_model", "messages": messages,
                                         "tools": tools, "max_tokens": 1, "temperature": 0.0})
    assert streamed.first_event_s is not None
    return streamed.first_event_s, streamed.usage.get("prompt_tokens", -1)


# -- our engine --------------------------------------------------------------------------------

def engine_first(engine: Any, ids: list[int], end: int, namespace: str,
                 **fields: Any) -> tuple[float, Any, Any]:
    """(TTFT, next-token logprobs, PrefillInfo) of one request through MLXEngine."""
    from engine_adapter.mlx_engine import GenerationRequest

    request = GenerationRequest(ids, max_tokens=1, specprefill_system_end=end,
                                namespace=namespace, return_logprobs=True, **fields)
    event = next(iter(engine.generate(request)))
    return event.elapsed_s, event.logprobs, event.prefill


def naive_boundary(renderer: Any, messages: list[dict[str, Any]], tools: Any,
                   prompt_len: int) -> int:
    non_system = [m for m in messages if m["role"] not in ("system", "developer")]
    return max(0, prompt_len - len(renderer.render_ids(non_system, tools, {})))


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn(*args, **kwargs)
    return time.perf_counter() - started, value


def run(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import load_model

    from engine_adapter.mlx_engine import MLXEngine
    from engine_adapter.testing.reference import kl_divergence
    from engine_adapter.testing.tiny_model import tiny_model_folder
    from prefix_cache import StaticPrefixCache
    from prefix_cache.render.render import get_renderer, unwrap_tokenizer
    from prefix_cache.testing.benchmark import bench_tools

    root = Path(args.models_dir)
    target_dir = tiny_model_folder(root / "bench-target", "qwen3", **TARGET)
    draft_dir = tiny_model_folder(root / "bench-draft", "qwen3", **DRAFT)
    loaded = load(str(target_dir))
    target, wrapper = loaded[0], loaded[1]
    draft = load_model(draft_dir)[0]
    tok = unwrap_tokenizer(wrapper)
    renderer = get_renderer(tok)
    tools = bench_tools(N_TOOLS)
    cache = StaticPrefixCache()

    engine = MLXEngine(target, draft_model=draft)                    # (d)
    baseline = MLXEngine(target, draft_model=draft, reuse_conversation_kv=False)  # (b), (c)
    dense = MLXEngine(target, reuse_static_kv=False, reuse_conversation_kv=False)  # (e)
    server, url = start_server(target_dir)
    log = print if args.verbose else (lambda *a, **k: None)
    try:
        first, _ = conversation("warm-up")
        first_ids = renderer.render_ids(first, tools, {})
        # Warm-up, untimed: kernels, the server's prompt cache (it sees turn 1 as a client would
        # have sent it), and our KV store (turn 1 through the cached boundary, both models).
        engine_first(dense, first_ids[:64], 0, "warm")
        warm = cache.resolve(tok, first, tools, prompt_ids=first_ids, namespace="d")
        server_ttft(url, first, tools)
        engine_first(engine, first_ids, warm.specprefill_system_end, "d", specprefill_threshold=0)
        # Turn 1 as it would really run (dense: its rest is under the threshold), which puts its
        # prompt into the engine's conversation store, as (a)'s server has it in its prompt cache.
        engine_first(engine, first_ids, warm.specprefill_system_end, "d", specprefill=False)
        naive = naive_boundary(renderer, first, tools, len(first_ids))
        engine_first(baseline, first_ids[:naive + 1], naive, "c")   # stores the naive prefix KV
        log(f"turn 1: {len(first_ids)} tokens, boundary {warm.specprefill_system_end}, "
            f"naive {naive}")

        rows: dict[str, dict[str, list[float]]] = {}
        meta: dict[str, dict[str, Any]] = {}

        def measure(workload: str, rep: int, messages: list[dict[str, Any]]) -> None:
            t_render, ids = timed(renderer.render_ids, messages, tools, {})
            t_resolve, result = timed(cache.resolve, tok, messages, tools,
                                      namespace="d")            # renders the prompt too
            assert result.hit and result.prompt_ids == ids
            t_naive, naive = timed(naive_boundary, renderer, messages, tools, len(ids))
            end = result.specprefill_system_end
            ttft_e, ref, _ = engine_first(dense, ids, 0, "e")
            measured: dict[str, tuple[float, float | None, Any]] = {}
            order = ["a", "b", "c", "d"]
            order = order[rep % 4:] + order[:rep % 4]          # rotate: no fixed position
            for variant in order:
                if variant == "a":
                    ttft, prompt_tokens = server_ttft(url, messages, tools)
                    assert prompt_tokens in (-1, len(ids)), (prompt_tokens, len(ids))
                    measured["a"] = (ttft, None, None)
                elif variant == "b":
                    ttft, lp, info = engine_first(baseline, ids, 0, "b")
                    measured["b"] = (t_render + ttft, kl_divergence(ref, lp), info)
                elif variant == "c":
                    ttft, lp, info = engine_first(baseline, ids, naive, "c")
                    measured["c"] = (t_render + t_naive + ttft, kl_divergence(ref, lp), info)
                else:
                    ttft, lp, info = engine_first(engine, ids, end, "d")
                    measured["d"] = (t_resolve + ttft, kl_divergence(ref, lp), info)
            measured["e"] = (t_render + ttft_e, 0.0, None)
            for variant, (ttft, kl, info) in measured.items():
                row = rows.setdefault(f"{workload}:{variant}", {"ttft": [], "kl": []})
                row["ttft"].append(ttft)
                if kl is not None:
                    row["kl"].append(kl)
                if info is not None:
                    meta.setdefault(f"{workload}:{variant}", []).append({
                        "mode": info.mode, "reused": info.reused_tokens,
                        "prefilled": info.prefilled_tokens, "kept": info.kept_tokens})
            meta[workload] = {"prompt_tokens": len(ids), "boundary": end,
                              "naive_boundary": naive}
            log(workload, rep, {k: (round(v[0], 3), v[1]) for k, v in measured.items()})
            mx.clear_cache()

        for rep in range(args.reps_short):
            user = f"Thanks. Now open the worker service (attempt {rep}) and fix its retries."
            measure("short", rep, conversation(user)[1])
        for rep in range(args.reps_long):
            user = ("Here is the incident report. Summarize it and list the actions:\n\n"
                    + document(tok, args.doc_tokens, seed=rep))
            messages = conversation(user)[1]
            measure("long", rep, messages)
            # The next turn: a short question on the document everyone has just prefilled.
            measure("follow-up", rep, messages + [
                {"role": "assistant", "content": "The report describes a failed rollout; the "
                                                 "actions are listed at its end."},
                {"role": "user", "content": "Which of those actions touch the worker service?"}])
    finally:
        server.terminate()
        server.wait(timeout=30)
        engine.close()
        baseline.close()
        dense.close()
    return {"rows": rows, "meta": meta, "machine": machine(),
            "target_params": non_embedding_params(TARGET),
            "draft_params": non_embedding_params(DRAFT)}


# -- the report --------------------------------------------------------------------------------

LABELS = {
    "a": "(a) mlx_lm.server, dense + its prompt cache",
    "b": "(b) SpecPrefill, whole prompt (no boundary)",
    "c": "(c) SpecPrefill, naive boundary",
    "d": "(d) cached boundary: static prefix (or an earlier prompt) reused, SpecPrefill on the rest",
    "e": "(e) in-process dense, no reuse (KL reference)",
}


TITLES = {
    "short": "short user turn",
    "long": "long user turn",
    "follow-up": "follow-up turn (a short question right after the long turn: (a) has that "
                 "prompt in its prompt cache, (d) its own KV of it, sparse after the boundary, in "
                 "its namespace's conversation store; (b) and (c) keep no conversation)",
}


def table(report: dict[str, Any], command: str) -> str:
    rows, meta = report["rows"], report["meta"]
    lines = [
        f"Machine: {report['machine']}.",
        f"Command: `{command}`.",
        f"Target: qwen3, {TARGET}, {report['target_params'] / 1e6:.2f} M non-embedding "
        f"parameters; draft: {DRAFT}, {report['draft_params'] / 1e6:.3f} M "
        f"(1/{report['target_params'] / report['draft_params']:.0f}); both float32, random "
        f"weights, real Qwen3 vocabulary (151,669 rows, tied embeddings).",
        "",
    ]
    for workload in ("short", "long", "follow-up"):
        if workload not in meta:
            continue
        m = meta[workload]
        anchor = statistics.median(rows[f"{workload}:a"]["ttft"])
        reps = len(rows[f"{workload}:a"]["ttft"])
        lines += [
            f"**{TITLES[workload]}** — prompt {m['prompt_tokens']} tokens, cached boundary "
            f"{m['boundary']}, naive boundary {m['naive_boundary']}; median of {reps} run(s).",
            "",
            "| variant | TTFT | vs (a) | KL(dense ‖ variant), nats | prefill path |",
            "|---|---:|---:|---:|---|",
        ]
        for v in "abcde":
            r = rows[f"{workload}:{v}"]
            ttft = statistics.median(r["ttft"])
            if v == "a":
                kl = "not exposed (dense)"
            elif v == "e":
                kl = "0 (the reference)"
            else:
                median_kl = statistics.median(r["kl"])
                kl = "< 1e-6" if abs(median_kl) < 1e-6 else f"{median_kl:.2e}"
            path = ("server-side" if v == "a" else "dense, nothing reused" if v == "e" else
                    prefill_paths(meta[f"{workload}:{v}"]))
            lines.append(f"| {LABELS[v]} | {ttft * 1000:.0f} ms | {anchor / ttft:.2f}x | {kl} "
                         f"| {path} |")
        runs = "; ".join(f"({v}) " + " / ".join(f"{t * 1000:.0f}" for t in rows[f"{workload}:{v}"]["ttft"])
                         for v in "ad")
        lines += ["", f"Each run's TTFT in ms, in run order: {runs}.", ""]
    return "\n".join(lines)


def prefill_paths(infos: list[dict[str, Any]]) -> str:
    """How the runs of one variant prefilled, each distinct way once, with its count."""
    counts: dict[str, int] = {}
    for info in infos:
        path = (f"{info['mode']}, {info['reused']} reused, {info['prefilled']} computed"
                + (f" ({info['kept']} kept after the boundary)" if info["kept"] else ""))
        counts[path] = counts.get(path, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return "; ".join(f"{path} ({n} of {len(infos)} runs)" for path, n in counts.items())


def update_docs(text: str, start: str = MARK_START, end: str = MARK_END,
                path: Path = DOCS) -> None:
    """Replace what lies between the markers ``start`` and ``end`` in ``path`` with ``text``."""
    doc = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{path} has no {start} ... {end} block")
    path.write_text(pattern.sub(lambda _m: f"{start}\n{text}\n{end}", doc), encoding="utf-8")


def families(args: argparse.Namespace, command: str, started: float) -> int:
    """The ``--families`` run: its table, printed and (``--update-docs``) written."""
    from engine_families import MARK_END as END
    from engine_families import MARK_START as START
    from engine_families import families_table, run_families

    rows = run_families(args)
    text = (families_table(rows, machine(), command)
            + f"\n\nWhole run: {time.perf_counter() - started:.0f} s.\n")
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    if args.update_docs:
        update_docs(text, START, END)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(),
                                                             "prefix-cache-bench-engine"))
    parser.add_argument("--reps-short", type=int, default=3)
    parser.add_argument("--reps-long", type=int, default=1)
    parser.add_argument("--doc-tokens", type=int, default=8400)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--update-docs", action="store_true",
                        help=f"write the table into {DOCS.relative_to(ROOT)}")
    parser.add_argument("--families", action="store_true",
                        help="instead: the second turn's TTFT per model family "
                             "(bench/engine_families.py)")
    parser.add_argument("--tools", default="64", help="with --families: tool counts, e.g. 64,100")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    command = "bash bench/engine.sh" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    if args.families:
        return families(args, command, started)
    report = run(args)
    report["seconds"] = time.perf_counter() - started
    text = table(report, command) + f"\nWhole run: {report['seconds']:.0f} s.\n"
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    if args.update_docs:
        update_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV disk tier benchmark: time to first token of the first request after an engine restart,
with the disk tier and without it, side by side in one run, on a 64-tool agent.

    bash bench/kv_disk.sh [--models tiny,demo] [--restarts 2] [--update-docs]

Per model (the tiny random-weights target of bench/engine.py, and the demo chat model
SmolLM2-135M-Instruct), two engines run the same agent side by side, one with the disk tier
(``kv_disk_bytes`` > 0) and one without (``kv_disk_bytes=0``); both keep their RAM stores.
Each engine is restarted (closed, loaded again from its folder: a new process would do the
same, and its disk store scans the folder) before every measured request, so what it has is
what the disk kept:

  next turn     the agent's next turn (its previous prompt, a tool call and its result, a new
                user message): with the disk tier, the previous prompt comes back from the
                conversation tier
  new session   a new conversation of the same agent (same system prompt and 64 tools, a new
                user message): with the disk tier, the static prefix comes back from disk

The order of the two engines alternates per restart. Then a second engine process is started
on the disk engine's folder while the first still runs, and its first request (a new session)
is timed: it reads the static prefix the first process wrote (``--second-baseline`` also times
one without the disk tier; by default the baseline is the new session's TTFT without it). The next-token
distributions of the two engines are compared on every measured request (max |logprob
difference|: restored KV must give the computed answer). The tools are ``bench_tools(64)``
with one parameter each, so the demo model's 8k context holds the prompt (a 5k+ token static
prefix).
"""

from __future__ import annotations

import argparse
import json
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

from engine import TARGET, machine, update_docs  # noqa: E402

N_TOOLS = 64
DISK_BYTES = 8 << 30
DOCS = ROOT / "docs" / "engine.md"
MARK_START, MARK_END = "<!-- bench:kv-disk:start -->", "<!-- bench:kv-disk:end -->"
CASES = ("next turn", "new session")
LAYERED = ("gemma3_text", "gpt_oss", "qwen3_next", "qwen3_5")   # --models may name these too


def agent_tools() -> list[dict[str, Any]]:
    """The 64 bench tools, each with its ``path`` parameter only."""
    from prefix_cache.testing.benchmark import bench_tools

    tools = bench_tools(N_TOOLS)
    for tool in tools:
        params = tool["function"]["parameters"]
        params["properties"] = {"path": params["properties"]["path"]}
    return tools


def session(n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(turn 1, turn 2) messages of the agent's session ``n``."""
    from prefix_cache.testing.benchmark import SYSTEM_PROMPT

    first = [{"role": "system", "content": SYSTEM_PROMPT},
             {"role": "user", "content": f"Session {n}: find the service configuration and "
                                         "tell me which services have no retry policy."}]
    second = first + [
        {"role": "assistant", "content": "Let me read the configuration first.",
         "tool_calls": [{"type": "function", "id": "call_1", "function": {
             "name": "workspace_tool_3", "arguments": '{"path": "deploy/services.yaml"}'}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": "services: [api (retries: 3), worker (retries: none), cron (retries: 1)]"},
        {"role": "user", "content": "Fix the worker's retry policy."}]
    return first, second


class Agent:
    """Prompt ids and boundaries of the agent's turns, for one model's tokenizer."""

    def __init__(self, folder: Path) -> None:
        from prefix_cache import StaticPrefixCache
        from prefix_cache.model_folders.model_dir import load_tokenizer

        self.tok = load_tokenizer(folder)
        self.tools = agent_tools()
        self.cache = StaticPrefixCache()

    def prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], int]:
        r = self.cache.resolve(self.tok, messages, self.tools)
        return r.prompt_ids, r.specprefill_system_end


def first_token(engine: Any, ids: list[int], end: int) -> tuple[float, Any, int]:
    """(TTFT, next-token logprobs, prompt tokens reused) of one request."""
    from engine_adapter.mlx_engine import GenerationRequest

    request = GenerationRequest(ids, max_tokens=1, specprefill_system_end=end,
                                return_logprobs=True)
    event = next(iter(engine.generate(request)))
    return event.elapsed_s, event.logprobs, event.prefill.reused_tokens


def load_engine(folder: Path, kv_dir: Path, disk: bool) -> tuple[Any, float]:
    """A fresh engine on ``folder`` (a restart), and the seconds its start took."""
    from engine_adapter.mlx_engine import MLXEngine

    started = time.perf_counter()
    engine = MLXEngine.load(folder, kv_disk_dir=kv_dir, kv_disk_bytes=DISK_BYTES if disk else 0)
    return engine, time.perf_counter() - started


def other_process(folder: Path, kv_dir: Path, disk: bool, ids: list[int],
                  end: int) -> dict[str, Any]:
    """The first request of a second engine process on the same folder."""
    out = subprocess.run(
        [sys.executable, __file__, "--second-process", json.dumps(
            {"folder": str(folder), "kv_dir": str(kv_dir), "disk": disk, "ids": ids,
             "end": end})], capture_output=True, text=True, check=True, timeout=1800)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def second_process(spec: str) -> int:
    args = json.loads(spec)
    engine, _ = load_engine(Path(args["folder"]), Path(args["kv_dir"]), args["disk"])
    try:
        ttft, _, reused = first_token(engine, args["ids"], args["end"])
    finally:
        engine.close()
    print(json.dumps({"ttft": ttft, "reused": reused}))
    return 0


def run_model(name: str, folder: Path, restarts: int, work: Path, log: Any,
              second_baseline: bool) -> dict[str, Any]:
    """Both engines on one model: the rows of the report."""
    import mlx.core as mx

    agent = Agent(folder)
    kv_dirs = {True: work / f"{name}-disk", False: work / f"{name}-nodisk"}
    engines: dict[bool, Any] = {}
    starts: dict[bool, list[float]] = {True: [], False: []}
    ttft: dict[tuple[str, bool], list[float]] = {}
    reused: dict[tuple[str, bool], list[int]] = {}
    diffs: list[float] = []
    shape: dict[str, int] = {}
    ids0, end0 = agent.prompt(session(0)[0])
    for disk in (True, False):
        engines[disk], _ = load_engine(folder, kv_dirs[disk], disk)
    # Turn 1 of session 0, untimed, on the engine with the disk tier (the other one forgets
    # it at its restart anyway): a computed prompt, unless --work names a folder that has it.
    first_token(engines[True], ids0, end0)
    try:
        for r in range(restarts):
            for case in CASES:
                messages = session(r)[1] if case == "next turn" else session(r + 1)[0]
                ids, end = agent.prompt(messages)
                shape[f"{case}:prompt"], shape["static"] = len(ids), end
                logprobs = {}
                order = (True, False) if r % 2 == 0 else (False, True)
                for disk in order:
                    engines[disk].close()              # the restart
                    engines[disk], started = load_engine(folder, kv_dirs[disk], disk)
                    starts[disk].append(started)
                    t, lp, n = first_token(engines[disk], ids, end)
                    ttft.setdefault((case, disk), []).append(t)
                    reused.setdefault((case, disk), []).append(n)
                    logprobs[disk] = lp
                    mx.clear_cache()
                diffs.append(mx.abs(logprobs[True] - logprobs[False]).max().item())
                log(name, r, case, {d: round(ttft[(case, d)][-1], 3) for d in order})
        ids, end = agent.prompt(session(restarts + 1)[0])
        second = {disk: other_process(folder, kv_dirs[disk], disk, ids, end)
                  for disk in ((True, False) if second_baseline else (True,))}
        log(name, "second process", second)
        disk_stats = engines[True].snapshot_stats().kv_disk
    finally:
        for engine in engines.values():
            engine.close()
    files = sorted(kv_dirs[True].rglob("*.safetensors"))
    return {"model": name, "static": shape["static"],
            "prompt": {c: shape[f"{c}:prompt"] for c in CASES},
            "ttft": {f"{c}:{d}": v for (c, d), v in ttft.items()},
            "reused": {f"{c}:{d}": v for (c, d), v in reused.items()},
            "start_s": {str(d): v for d, v in starts.items()},
            "second": {str(d): v for d, v in second.items()},
            "max_logprob_diff": max(diffs),
            "disk": {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
                     "mean_load_s": disk_stats.load_seconds / max(1, disk_stats.loads)}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine_adapter.demo_model import demo_chat_model_dir
    from engine_adapter.testing.tiny_model import tiny_model_folder

    log = print if args.verbose else (lambda *a, **k: None)
    folders = {"tiny": lambda: tiny_model_folder(Path(args.models_dir) / "bench-target",
                                                 "qwen3", **TARGET),
               "demo": demo_chat_model_dir}
    # The layered families (sliding windows, recurrent state): their snapshots on disk too.
    for arch in LAYERED:
        folders[arch] = (lambda a=arch: tiny_model_folder(Path(args.models_dir)
                                                           / f"bench-{a}", a, **TARGET))
    results = []
    with tempfile.TemporaryDirectory(prefix="kv-disk-bench-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        for name in args.models.split(","):
            results.append(run_model(name, folders[name](), args.restarts, work, log,
                                     args.second_baseline))
    return {"models": results, "machine": machine(), "restarts": args.restarts}


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:,.0f} ms"


def table(report: dict[str, Any], command: str) -> str:
    lines = [f"Machine: {report['machine']} (shared with other builds while it ran).",
             f"Command: `{command}`; {report['restarts']} restarts per case and engine, "
             "medians.", "",
             "| model | case (first request after a restart) | prompt tokens | static prefix "
             "| TTFT without disk tier | TTFT with disk tier | speedup | cached_tokens with "
             "disk (without) |",
             "|---|---|---|---|---|---|---|---|"]
    for m in report["models"]:
        for case in CASES:
            off, on = m["ttft"][f"{case}:False"], m["ttft"][f"{case}:True"]
            lines.append(
                f"| {m['model']} | {case} | {m['prompt'][case]:,} | {m['static']:,} | {ms(off)} "
                f"| {ms(on)} | {statistics.median(off) / statistics.median(on):.1f}x "
                f"| {statistics.median(m['reused'][f'{case}:True']):,.0f} "
                f"({statistics.median(m['reused'][f'{case}:False']):,.0f}) |")
        s_on, s_off = m["second"]["True"], m["second"].get("False")
        # Without --second-baseline, the baseline is the new session's TTFT without the disk
        # tier: the same prompt, the first request of a freshly loaded engine too.
        off_s = s_off["ttft"] if s_off else statistics.median(m["ttft"]["new session:False"])
        off_text = f"{off_s * 1000:,.0f} ms" + ("" if s_off else " (new session, above)")
        lines.append(
            f"| {m['model']} | second engine process, new session | {m['prompt']['new session']:,} "
            f"| {m['static']:,} | {off_text} | {s_on['ttft'] * 1000:,.0f} ms "
            f"| {off_s / s_on['ttft']:.1f}x | {s_on['reused']:,} "
            f"({s_off['reused'] if s_off else 0:,}) |")
    lines += ["", "| model | engine start with / without disk tier (median) | files on disk, "
              "bytes | mean load of a file | max \\|logprob difference\\| with vs without |",
              "|---|---|---|---|---|"]
    for m in report["models"]:
        d = m["disk"]
        lines.append(
            f"| {m['model']} | {ms(m['start_s']['True'])} / {ms(m['start_s']['False'])} "
            f"| {d['files']}, {d['bytes'] / 2**20:,.1f} MiB | {d['mean_load_s'] * 1000:,.1f} ms "
            f"| {m['max_logprob_diff']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,demo", help="comma-separated: tiny, demo, "
                        + ", ".join(LAYERED) + " (tiny random-weights models of those families)")
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--models-dir", default=str(Path(tempfile.gettempdir())
                                                    / "prefix-cache-bench-engine"))
    parser.add_argument("--work", help="folder of the engines' KV folders (default: a "
                        "temporary one); one an earlier run filled starts the disk engine warm")
    parser.add_argument("--second-baseline", action="store_true", help="also time a second "
                        "process without the disk tier (a full prefill more)")
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument("--json", help="also write the raw report here")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--second-process", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.second_process:
        return second_process(args.second_process)
    report = run(args)
    command = "bash bench/kv_disk.sh " + " ".join(a for a in (argv or sys.argv[1:])
                                                  if a != "--verbose")
    text = table(report, command.strip())
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.update_docs:
        update_docs(text, MARK_START, MARK_END, DOCS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

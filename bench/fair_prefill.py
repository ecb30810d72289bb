"""Fair prefill: a quiet tenant's time to first token while another floods the engine with long
prompts, first come first served vs the step's token budget, side by side in one run (issue
42, item 8; issue 52).

    LD_PRELOAD=<openblas> PYTHONPATH=$PWD python bench/fair_prefill.py [--flood-tokens 512]
        [--flood-streams 16] [--quiet 8] [--repeats 3] [--step-tokens 512,1024] [--output FILE]

The engine is the real one on a tiny random-weights model (only time matters). Each repeat
runs: no flood (the first budget), a flood with ``fair_prefill=False`` (mlx-lm's own order:
first come first served), a flood with each budget (``fair_prefill=True``, ``step_tokens``).
The flood
keeps ``--flood-streams`` prompts of ``--flood-tokens`` tokens in the engine at all times
(namespace "flood"); the quiet tenant sends ``--quiet`` prompts of 200 tokens one after another
(namespace "quiet"), each answered with 1 token, and its TTFT (from submit to the first token,
as the engine measures it) is recorded. Ratios are against the same repeat's no-flood run.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

QUIET_TOKENS = 200


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(model: Any, vocab: int, *, flood: bool, budget: int | None, args: argparse.Namespace,
        ) -> dict[str, float]:
    from engine_adapter.mlx_engine import GenerationRequest, MLXEngine

    engine = MLXEngine(model, fair_prefill=budget is not None, step_tokens=budget or 512,
                       reuse_static_kv=False, reuse_conversation_kv=False)
    stop = threading.Event()
    flood_tokens = [0]
    counter = itertools.count()

    def flooder() -> None:
        while not stop.is_set():
            n = next(counter)
            ids = [(n * 7919 + j * 31) % vocab for j in range(args.flood_tokens)]
            for _ in engine.generate(GenerationRequest(ids, max_tokens=1, namespace="flood")):
                pass
            flood_tokens[0] += args.flood_tokens

    threads = [threading.Thread(target=flooder, daemon=True)
               for _ in range(args.flood_streams if flood else 0)]
    for t in threads:
        t.start()
    time.sleep(args.warmup_s if flood else 0.0)  # the flood fills the engine first
    started, before = time.perf_counter(), flood_tokens[0]
    ttfts = []
    for i in range(args.quiet):
        ids = [(i * 131 + j) % vocab for j in range(QUIET_TOKENS)]
        events = list(engine.generate(GenerationRequest(ids, max_tokens=1, namespace="quiet")))
        ttfts.append(events[0].elapsed_s)
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    flooded = flood_tokens[0] - before
    stop.set()
    for t in threads:
        t.join()
    engine.close()
    return {"p50": statistics.median(ttfts), "p99": percentile(ttfts, 0.99),
            "flood_tok_s": flooded / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # More flood streams than the engine's 8 prefill slots: first come first served, a
    # newcomer waits behind a queue of them.
    parser.add_argument("--flood-tokens", type=int, default=512)
    parser.add_argument("--flood-streams", type=int, default=16)
    parser.add_argument("--quiet", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-tokens", default="512",
                        help="budgets to compare with FCFS, comma-separated: 512,1024")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    from mlx_lm.utils import load_model

    from engine_adapter.testing.tiny_model import tiny_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_model_folder(Path(tmp) / "tiny", hidden=args.hidden, layers=args.layers)
        model = load_model(folder)[0]
    from engine_adapter.mlx_engine.model_info import vocab_size

    vocab = vocab_size(model) or 32000
    budgets = [int(b) for b in args.step_tokens.split(",")]
    # (name, flood, budget): the unloaded run has the first budget (the default engine)
    modes = [("no flood", False, budgets[0]), ("flood, first come first served", True, None)]
    modes += [(f"flood, step budget {b}", True, b) for b in budgets]
    names = [m[0] for m in modes]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name, flood, budget in modes:
            runs[name].append(run(model, vocab, flood=flood, budget=budget, args=args))
    lines = [f"Quiet tenant's TTFT ({args.quiet} prompts of {QUIET_TOKENS} tokens, one after "
             f"another) while {args.flood_streams} streams of another tenant "
             f"keep {args.flood_tokens}-token prompts in the engine; tiny random-weights "
             f"Qwen3 (hidden {args.hidden}, {args.layers} layers, float32), prefill batch 8, "
             f"step 2048; {args.repeats} repeats, each its runs one after another. {platform.machine()}, {platform.system()}.",
             "", "| run | repeat | quiet p50 TTFT | quiet p99 TTFT | p50 vs no flood | "
             "p99 vs no flood | flood prompt tokens/s | flood tokens/s vs FCFS |",
             "|---|---|---|---|---|---|---|---|"]
    for i in range(args.repeats):
        base, fcfs = runs[names[0]][i], runs[names[1]][i]
        for name in names:
            r = runs[name][i]
            vs = f"{r['flood_tok_s'] / fcfs['flood_tok_s']:.2f}x" if r["flood_tok_s"] else "-"
            lines.append(f"| {name} | {i + 1} | {r['p50'] * 1000:.0f} ms | "
                         f"{r['p99'] * 1000:.0f} ms | {r['p50'] / base['p50']:.1f}x | "
                         f"{r['p99'] / base['p99']:.1f}x | {r['flood_tok_s']:.0f} | {vs} |")
    table = "\n".join(lines)
    print(table)
    if args.output:
        args.output.write_text(table + "\n")


if __name__ == "__main__":
    main()

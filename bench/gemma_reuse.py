"""Gemma 3 270M (real weights, sliding-window layers) on the KV disk tier and with its reply sent
back (issue 55, goal 4): the time to first token of turn 2 three ways, side by side in one
process, on the same turn-2 prompt ids:

  cold          a new engine, no KV at all: the whole prompt computed
  restart+disk  a new engine on the disk folder turn 1 wrote (its prompt and reply, one layered
                entry): restored from disk
  reply kept    the engine that ran turn 1 (no disk tier), its reply's KV kept in RAM

Turn 1 is a long system text (Gemma 3's template puts it into the first user turn) and a
question; turn 2 sends turn 1's generated ids back and asks on. Per repeat the three run in a
rotating order; medians. The first token's logprobs of each are compared with the cold run's
(max |logprob difference|).

    bash bench/gemma_reuse.sh [--words 2000] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine import machine  # noqa: E402

GIB = 1 << 30
REPLY_TOKENS = 16
CASES = ("cold", "restart+disk", "reply kept")


def turn_one(tok: Any, words: int, rep: int) -> tuple[list[int], int]:
    """Turn 1's ids (rendered by Gemma 3's template, as the proxy resolves them) and its static
    end; ``rep`` changes the question, so every repeat is a new conversation."""
    from prefix_cache import StaticPrefixCache

    system = "You keep the warehouse inventory. " + " ".join(
        f"Shelf {i} holds item {i * 7 % 101} in bin {i % 13}." for i in range(words // 9))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Which shelf holds item {17 + rep}?"}]
    resolved = StaticPrefixCache().resolve(tok, messages)
    return list(resolved.prompt_ids), resolved.specprefill_system_end


def send_back(tok: Any, prompt: list[int], reply: list[int], user: str) -> list[int]:
    """Turn 2: turn 1's prompt, its reply's ids as generated, a new user turn, the header."""
    return prompt + reply + tok.encode(f"<end_of_turn>\n<start_of_turn>user\n{user}"
                                       "<end_of_turn>\n<start_of_turn>model\n",
                                       add_special_tokens=False)


def request(engine: Any, ids: list[int], end: int, max_tokens: int) -> list[Any]:
    from engine_adapter.mlx_engine import GenerationRequest

    return list(engine.generate(GenerationRequest(ids, max_tokens=max_tokens,
                                                  specprefill_system_end=end,
                                                  return_logprobs=True)))


def run(words: int, repeats: int, log: Any) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load

    from engine_adapter.gemma_model import gemma_model_dir
    from engine_adapter.mlx_engine import MLXEngine
    from engine_adapter.mlx_engine.kv import file as kv_file
    from engine_adapter.mlx_engine.kv.disk import DiskKVStore

    model, tok = load(str(gemma_model_dir()))[:2]
    fingerprints = {"target": kv_file.model_fingerprint(model)}
    ttft: dict[str, list[float]] = {c: [] for c in CASES}
    reused: dict[str, list[int]] = {c: [] for c in CASES}
    diffs: dict[str, float] = {c: 0.0 for c in CASES if c != "cold"}
    shape: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="gemma-reuse-bench-") as tmp:
        for rep in range(repeats):
            folder = Path(tmp) / f"kv{rep}"

            def disk_engine() -> Any:
                return MLXEngine(model, kv_disk=DiskKVStore(folder, GIB,
                                                            fingerprints=fingerprints))

            first, end = turn_one(tok, words, rep)
            writer = disk_engine()            # turn 1, untimed: writes prompt and reply
            reply = [e.token for e in request(writer, first, end, REPLY_TOKENS)]
            writer.close()
            writer.kv_disk.close()
            kept = MLXEngine(model)           # turn 1 again, its reply's KV kept in RAM
            assert [e.token for e in request(kept, first, end, REPLY_TOKENS)] == reply
            second = send_back(tok, first, reply, "And which bin is it in?")
            shape.update(turn1=len(first), reply=len(reply), turn2=len(second), static=end)
            engines = {"cold": lambda: MLXEngine(model), "restart+disk": disk_engine,
                       "reply kept": lambda: kept}
            logprobs: dict[str, Any] = {}
            order = CASES[rep % 3:] + CASES[:rep % 3]
            for case in order:
                engine = engines[case]()
                started = time.perf_counter()
                event = request(engine, second, end, 1)[0]
                ttft[case].append(event.elapsed_s)
                reused[case].append(event.prefill.reused_tokens)
                logprobs[case] = event.logprobs
                log(rep, case, f"{event.elapsed_s:.3f}s", event.prefill,
                    f"(wall {time.perf_counter() - started:.3f}s)")
                engine.close()
                if engine.kv_disk is not None:
                    engine.kv_disk.close()
                mx.clear_cache()
            for case in diffs:
                diffs[case] = max(diffs[case], mx.abs(logprobs[case] - logprobs["cold"])
                                  .max().item())
    return {"machine": machine(), "words": words, "repeats": repeats, "shape": shape,
            "ttft": ttft, "reused": reused, "max_logprob_diff": diffs}


def table(report: dict[str, Any], command: str) -> str:
    s, ttft = report["shape"], report["ttft"]
    cold = statistics.median(ttft["cold"])
    lines = [f"Command: `{command}`; {report['repeats']} repeats, medians. Turn 1: "
             f"{s['turn1']:,} tokens (static prefix {s['static']:,}), reply {s['reply']} "
             f"tokens; turn 2: {s['turn2']:,} tokens.", "",
             "| turn 2 | TTFT | vs cold | tokens reused | max \\|logprob difference\\| vs cold |",
             "|---|---|---|---|---|"]
    for case in CASES:
        t = statistics.median(ttft[case])
        diff = report["max_logprob_diff"].get(case)
        lines.append(f"| {case} | {t * 1000:,.0f} ms | {cold / t:.1f}x "
                     f"| {statistics.median(report['reused'][case]):,.0f} "
                     f"| {'-' if diff is None else f'{diff:.2e}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--words", type=int, default=2000, help="about the system text's words")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the raw report here")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    report = run(args.words, args.repeats, print if args.verbose else (lambda *a, **k: None))
    command = "bash bench/gemma_reuse.sh " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--verbose")
    print(f"Machine: {report['machine']}")
    print(table(report, command.strip()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

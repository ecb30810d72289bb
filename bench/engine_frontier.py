"""The quality/TTFT frontier on real weights: answers equal to dense (and KL to dense) against
median TTFT, for SpecPrefill without a boundary (b), with the naive one (c) and with the cached
one (d), each at a sweep of keep shares, with dense in-process and mlx_lm.server as points.

    bash bench/engine_frontier.sh [--prompts 20] [--max-minutes 45] [--update-docs]
    bash bench/engine_frontier.sh --from-json frontier.json --update-docs   (table and plot again)

The turns are the quality benchmark's (``bench/engine_quality.py``, ``agent_workload``): the
operations agent's system prompt and 8 tools (the static prefix), a fresh ~950-token postmortem
and a question on one of its facts. On every turn: dense in-process first (the reference: its
greedy answer is what "= dense" means, its first next-token distribution the KL reference),
then mlx_lm.server and every (variant, keep share) in a rotating order. A SpecPrefill answer
is read only until its first token that differs from dense's: by then it is known not to be
equal (that saves most of the decoding, never changes a count). TTFT includes what the client
spends on ids and boundary, as in the quality benchmark.

The run stops starting turns after ``--max-minutes`` (the table says how many it made); the raw
figures are written after every turn (``--json``), so a cut run still gives its table and plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from agent_workload import agent_prompt  # noqa: E402
from engine import machine, naive_boundary, start_server, timed, update_docs  # noqa: E402
from engine_quality import (  # noqa: E402
    close_all,
    engine_answer,
    load_models,
    make_engines,
    server_answer,
)

DOCS = ROOT / "docs" / "engine.md"
PLOT = ROOT / "docs" / "engine-frontier.svg"
MARK_START, MARK_END = "<!-- bench:frontier:start -->", "<!-- bench:frontier:end -->"
KEEPS = (0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
CURVES = {"b": "(b) no boundary", "c": "(c) naive boundary", "d": "(d) cached boundary",
          "g": "(g) cached boundary, the draft's layers reused"}


def greedy_answer(engine: Any, ids: list[int], end: int, namespace: str, max_tokens: int, *,
                  keep: float | None = None,
                  reference: list[int] | None = None) -> tuple[float, Any, list[int]]:
    """(TTFT, first next-token logprobs, the greedy tokens) of one request; with
    ``reference``, tokens are read only until one differs from it (the rest is cancelled)."""
    from engine_adapter.mlx_engine import GenerationRequest

    request = GenerationRequest(ids, max_tokens=max_tokens, specprefill_system_end=end,
                                namespace=namespace, return_logprobs=True,
                                specprefill_keep_pct=keep)
    events = engine.generate(request)
    ttft, logprobs, tokens = 0.0, None, list[int]()
    try:
        for event in events:
            if not tokens:
                ttft, logprobs = event.elapsed_s, event.logprobs
            tokens.append(event.token)
            if reference is not None and tokens != reference[:len(tokens)]:
                break
    finally:
        events.close()
    return ttft, logprobs, tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from engine_adapter.testing.reference import kl_divergence
    from prefix_cache import StaticPrefixCache

    models = load_models(args.draft_layers)
    tok, renderer = models.tokenizer, models.renderer
    cache = StaticPrefixCache()
    engine, baseline, dense = make_engines(models, None, args.tail_tokens)
    layered = layered_engine(models, args.tail_tokens) if "g" in args.variants else None
    server, url = start_server(models.target_dir) if args.server else (None, "")
    report: dict[str, Any] = {"command": args.command, "machine": machine(),
                              "variants": args.variants, "server": args.server,
                              "draft_layers": args.draft_layers,
                              "keeps": list(args.keeps), "tail_tokens": args.tail_tokens,
                              "max_tokens": args.max_tokens, "prompts": args.prompts,
                              "turns": []}
    started = time.perf_counter()
    try:
        warm = [{"role": "user", "content": "Say hello."}]
        for eng in (engine, baseline, dense, layered):
            if eng is not None:
                engine_answer(eng, tok, renderer.render_ids(warm, None, {}), 0, "warm", 2)
        if server is not None:
            server_answer(url, warm, [], 2)
        points = ([("a", None)] if server is not None else []) + [
            (v, k) for k in args.keeps for v in CURVES if v in args.variants]
        for turn in range(args.prompts):
            if time.perf_counter() - started > args.max_minutes * 60:
                break
            prompt = agent_prompt(args.seed + turn)
            messages, tools = prompt.messages, prompt.tools
            t_render, ids = timed(renderer.render_ids, messages, tools, {})
            t_resolve, result = timed(cache.resolve, tok, messages, tools, namespace="d")
            t_naive, naive = timed(naive_boundary, renderer, messages, tools, len(ids))
            end = result.specprefill_system_end
            ttft, ref, reference = greedy_answer(dense, ids, end, "e", args.max_tokens)
            text = tok.decode([t for t in reference if t not in models.stop])
            row: dict[str, Any] = {"turn": turn, "prompt_tokens": len(ids), "boundary": end,
                                   "naive_boundary": naive, "dense_text": text,
                                   "e": {"ttft": t_render + ttft, "kl": 0.0, "agrees": True}}
            shift = turn % len(points)
            for v, keep in points[shift:] + points[:shift]:       # no fixed position
                if v == "a":
                    ttft, answer = server_answer(url, messages, tools, args.max_tokens)
                    row["a"] = {"ttft": ttft, "kl": None,
                                "agrees": answer.strip() == text.strip()}
                    continue
                eng, boundary, spent = {"b": (baseline, 0, t_render),
                                        "c": (baseline, naive, t_render + t_naive),
                                        "d": (engine, end, t_resolve),
                                        "g": (layered, end, t_resolve)}[v]
                # (d): one namespace per share, so no share restores another's sparse KV.
                ttft, lp, tokens = greedy_answer(eng, ids, boundary, f"{v}{keep}",
                                                 len(reference), keep=keep,
                                                 reference=reference)
                row[f"{v}{keep}"] = {"ttft": spent + ttft, "kl": kl_divergence(ref, lp),
                                     "agrees": tokens == reference}
            report["turns"].append(row)
            report["seconds"] = time.perf_counter() - started
            if args.json:
                args.json.write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
            if args.verbose:
                print(f"turn {turn}: " + " ".join(
                    f"{k}={'=' if r['agrees'] else '≠'}{r['ttft']:.1f}s"
                    for k, r in row.items() if isinstance(r, dict)), flush=True)
            mx.clear_cache()
    finally:
        close_all(server, tuple(e for e in (engine, baseline, dense, layered) if e is not None))
    return report


def layered_engine(models: Any, tail_tokens: int) -> Any:
    """(g)'s engine: (d)'s, with the target reusing the draft's layers (``draft_layers``)."""
    from engine_adapter.mlx_engine import MLXEngine, SpecPrefillConfig

    config = SpecPrefillConfig(threshold=256, tail_tokens=tail_tokens, reuse_draft_layers=True)
    return MLXEngine(models.target, draft_model=models.draft, specprefill=config,
                     stop_token_ids=models.stop)


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One point per (variant, keep share), dense and mlx_lm.server included: median TTFT,
    answers equal to dense, mean KL."""
    turns = report["turns"]
    variants = report.get("variants", "bcd")
    keys = [("e", None, "dense in-process")] + (
        [("a", None, "mlx_lm.server (dense)")] if report.get("server", True) else []) + [
        (v, k, CURVES[v]) for v in CURVES if v in variants for k in report["keeps"]]
    points = []
    for v, keep, label in keys:
        rows = [t[v if keep is None else f"{v}{keep}"] for t in turns]
        kls = [r["kl"] for r in rows if r["kl"] is not None]
        points.append({"variant": v, "keep": keep, "label": label,
                       "ttft": statistics.median(r["ttft"] for r in rows),
                       "agree": sum(r["agrees"] for r in rows),
                       "kl": statistics.mean(kls) if kls else None})
    return points


def d_at(points: list[dict[str, Any]], ttft: float) -> tuple[float | None, int | None]:
    """(d)'s answers equal to dense at ``ttft``: interpolated linearly between its points, and
    the best of its points at most that TTFT (None: it has none that fast)."""
    curve = sorted((p["ttft"], p["agree"]) for p in points if p["variant"] == "d")
    if not curve:
        return None, None
    below = [a for t, a in curve if t <= ttft]
    best = max(below) if below else None
    if ttft < curve[0][0]:
        return None, best
    if ttft >= curve[-1][0]:
        return float(curve[-1][1]), best
    for (t0, a0), (t1, a1) in zip(curve, curve[1:], strict=False):
        if t0 <= ttft <= t1:
            return a0 + (a1 - a0) * (ttft - t0) / (t1 - t0 or 1.0), best
    return None, best


def table(report: dict[str, Any], command: str) -> str:
    turns = report["turns"]
    n = len(turns)
    points = summarize(report)
    lines = [
        f"Machine: {report['machine']}; shared with other engineers' builds and benchmarks "
        f"while it ran, so TTFTs carry that load (all points of a turn ran back to back, in a "
        f"rotating order).",
        f"Command: `{command}`.",
        f"{n} turns" + (f" (of {report['prompts']} asked: the run stopped there, for time)"
                        if n < report["prompts"] else "")
        + f", prompts {min(t['prompt_tokens'] for t in turns)}-"
        f"{max(t['prompt_tokens'] for t in turns)} tokens, cached boundary "
        f"{turns[0]['boundary']}, naive boundary {turns[0]['naive_boundary']}; draft: the "
        f"first {report['draft_layers']} layers; tail {report['tail_tokens']} tokens, threshold "
        f"256; greedy answers of up to {report['max_tokens']} tokens. Plot: "
        f"[engine-frontier.svg](engine-frontier.svg).",
        "",
        "| variant | keep | TTFT (median) | answers = dense | KL(dense ‖ variant), mean | "
        "(d) at this TTFT: interpolated / best point at most it |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    misses: dict[str, list[str]] = {"interpolated": [], "measured": []}
    for p in points:
        keep = "" if p["keep"] is None else f"{p['keep']:.0%}"
        kl = "0 (the reference)" if p["variant"] == "e" else (
            # max: at keep 100% the KL is 0 up to float rounding, which can print as -0.000
            "not exposed" if p["kl"] is None else f"{max(p['kl'], 0.0):.3f}")
        interp, best = d_at(points, p["ttft"])
        where = "" if p["variant"] == "d" else (
            f"{'-' if interp is None else f'{interp:.1f}'} / {'-' if best is None else best}")
        if p["variant"] in "bc" and (interp is None or interp < p["agree"]):
            misses["interpolated"].append(f"{p['label']} at {keep}")
        if p["variant"] in "bc" and (best is None or best < p["agree"]):
            misses["measured"].append(f"{p['label']} at {keep}")
        lines.append(f"| {p['label']} | {keep} | {p['ttft'] * 1000:.0f} ms | {p['agree']}/{n} "
                     f"| {kl} | {where} |")
    lines += ["", "Where (d) at the same TTFT has fewer answers equal to dense: "
              + (", ".join(misses["interpolated"]) or "none") + " (interpolated between (d)'s "
              "points); where none of (d)'s measured points at most that TTFT has as many: "
              + (", ".join(misses["measured"]) or "none") + "."]
    if {"d", "g"} <= set(report.get("variants", "bcd")):
        lines += ["", "(g) against (d), turn by turn (the points of a turn ran back to back):", "",
                  "| keep | TTFT (g)/(d), median over turns (min-max) | turns where (g)'s KL is "
                  "lower |", "|---:|---:|---:|"]
        for keep in report["keeps"]:
            pairs = [(t[f"g{keep}"], t[f"d{keep}"]) for t in turns]
            ratios = [g["ttft"] / d["ttft"] for g, d in pairs]
            lower = sum(g["kl"] < d["kl"] for g, d in pairs)
            lines.append(f"| {keep:.0%} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-"
                         f"{max(ratios):.2f}) | {lower}/{n} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Answers equal to dense and mean KL against median TTFT: a curve per variant, dense and
    mlx_lm.server as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = summarize(report)
    n = len(report["turns"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    for v, label in CURVES.items():
        curve = sorted((p for p in points if p["variant"] == v), key=lambda p: p["ttft"])
        if not curve:
            continue
        xs = [p["ttft"] for p in curve]
        line = top.plot(xs, [p["agree"] for p in curve], "o-", label=label)[0]
        bottom.plot(xs, [p["kl"] for p in curve], "o-", color=line.get_color(), label=label)
        for p in curve:
            top.annotate(f"{p['keep']:.0%}", (p["ttft"], p["agree"]), fontsize=7,
                         textcoords="offset points", xytext=(3, 3))
    for p, marker in zip([p for p in points if p["variant"] in "ea"], ("*", "s"),
                         strict=False):
        top.plot([p["ttft"]], [p["agree"]], marker, markersize=11, label=p["label"],
                 linestyle="none")
    top.set_ylabel(f"answers equal to dense (of {n})")
    top.set_title("SmolLM2-135M-Instruct: quality against TTFT (labels: keep share)")
    bottom.set_ylabel("mean KL(dense ‖ variant), nats")
    bottom.set_xlabel("median TTFT, s (CPU, shared machine)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20, help="turns (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="first turn's seed")
    parser.add_argument("--keeps", type=lambda s: [float(x) for x in s.split(",")],
                        default=list(KEEPS), help="keep shares (default 0.1,...,1.0)")
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--tail-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-minutes", type=float, default=60.0,
                        help="start no turn after this many minutes (default 60)")
    parser.add_argument("--json", type=Path, help="write the raw figures here after every turn")
    parser.add_argument("--from-json", type=Path, help="table and plot from an earlier run")
    parser.add_argument("--update-docs", action="store_true",
                        help=f"write the table into {DOCS.relative_to(ROOT)} and the plot "
                             f"to {PLOT.relative_to(ROOT)}")
    parser.add_argument("--variants", default="bcd",
                        help="curves: b, c, d and g ((d) with the draft's layers reused)")
    parser.add_argument("--no-server", dest="server", action="store_false",
                        help="no mlx_lm.server point")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if set(args.variants) - set(CURVES):
        parser.error(f"variants are letters of {''.join(CURVES)}, got {args.variants!r}")
    if any(not 0.0 < k <= 1.0 for k in args.keeps):
        parser.error(f"keep shares must be in (0, 1], got {args.keeps}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.from_json:
        report = json.loads(args.from_json.read_text(encoding="utf-8"))
        command = report["command"]
    else:
        command = args.command = "bash bench/engine_frontier.sh" + "".join(
            f" {a}" for a in (argv or sys.argv[1:]))
        report = run(args)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    if not report["turns"]:
        raise SystemExit("no turn finished")
    text = table(report, command) + f"Whole run: {report['seconds']:.0f} s.\n"
    print(text)
    if args.update_docs:
        update_docs(text, MARK_START, MARK_END, DOCS)
        plot(report, PLOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())

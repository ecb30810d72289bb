"""SpecPrefill on sliding-window and recurrent families (``specprefill_hybrid``), against dense:
time to first token at 8k and 16k tokens, KL of the first token's distribution to dense, and
whether the greedy answer equals dense, side by side in one run.

    bash bench/hybrid_specprefill.sh [--families gemma3_text,gpt_oss,qwen3_next,qwen3_5]
        [--lengths 8192,16384] [--keep 0.3] [--reps 2] [--update-docs]
    bash bench/hybrid_specprefill.sh --model DIR --draft DIR     # a real hybrid folder
    bash bench/hybrid_specprefill.sh --model gemma --lengths 4096,8192 --static 2048 \\
        --keep 0.2,0.35,0.5 --variants db      # Gemma 3 270M, real weights, both boundaries

Per model and length, ``--reps`` prompts (a ``--static``-token static prefix, then the rest),
each served twice by one engine with the option on and no KV stores (every run cold): dense
(``specprefill=False``) and SpecPrefill (``keep_pct`` ``--keep``), the order alternating per
rep. Tiny families: random weights (hidden 128, 4 layers; the Qwen3 vocabulary), a draft of
hidden 32 and 1 layer, random prompt ids; a real folder gets a document of words instead.
Random weights say nothing of quality: there the KL and answers only show the mechanics.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DOCS = ROOT / "docs" / "engine.md"
MARK_START, MARK_END = "<!-- bench:hybrid-specprefill:start -->", "<!-- bench:hybrid-specprefill:end -->"
# A real model's table (--model) has its own place in docs/engine.md.
REAL_START, REAL_END = ("<!-- bench:hybrid-specprefill-real:start -->",
                        "<!-- bench:hybrid-specprefill-real:end -->")
SHAPE = {"hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 384}
ANSWER_TOKENS = 16


def serve(engine: Any, ids: list[int], static: int, sparse: bool,
          keep: float | None = None) -> dict[str, Any]:
    """TTFT, first-token logprobs, the greedy answer and the prefill info of one request."""
    from engine_adapter.mlx_engine import GenerationRequest

    request = GenerationRequest(ids, max_tokens=ANSWER_TOKENS, specprefill_system_end=static,
                                specprefill=sparse, return_logprobs=True,
                                specprefill_keep_pct=keep if sparse else None)
    started = time.perf_counter()
    events = list(engine.generate(request))
    return {"ttft": events[0].elapsed_s if events[0].elapsed_s else time.perf_counter() - started,
            "logprobs": events[0].logprobs, "answer": [e.token for e in events],
            "info": events[0].prefill}


def kl(dense: Any, sparse: Any) -> float:
    import mlx.core as mx

    return float((mx.exp(dense) * (dense - sparse)).sum().item())


def prompts(tok: Any, vocab: int, length: int, static: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    if tok is None:
        return [rng.randrange(vocab) for _ in range(length)]
    from engine import document

    ids = tok.encode(document(tok, length, seed), add_special_tokens=False)
    return (ids * (length // max(1, len(ids)) + 1))[:length]


def measure(name: str, model: Any, draft: Any, tok: Any, args: argparse.Namespace) -> list[dict]:
    """Per length and rep: one dense run, then SpecPrefill at each keep share with the static
    prefix kept dense (``d``: the cached boundary) and, with ``--variants bd``, with no boundary
    (``b``); the dense run first or last by turns. One row per (length, keep, variant)."""
    from engine_adapter.mlx_engine import MLXEngine
    from engine_adapter.mlx_engine.model_info import vocab_size
    from engine_adapter.mlx_engine.specprefill import SpecPrefillConfig

    keeps = [float(k) for k in str(args.keep).split(",")]
    config = SpecPrefillConfig(keep_pct=keeps[0], threshold=0, hybrid=True)
    rows = []
    vocab = min(vocab_size(model) or 32000, vocab_size(draft) or 32000)
    with MLXEngine(model, draft_model=draft, specprefill=config, reuse_static_kv=False,
                   reuse_conversation_kv=False) as engine:
        serve(engine, prompts(tok, vocab, 256, 64, 0), 64, True, keeps[0])   # warm-up, both
        serve(engine, prompts(tok, vocab, 256, 64, 0), 64, False)
        for length in (int(x) for x in args.lengths.split(",")):
            static = min(args.static, length // 2)
            sparse_runs = [(keep, v) for keep in keeps for v in args.variants]
            runs: dict[Any, list[Any]] = {key: [] for key in ["dense", *sparse_runs]}
            for rep in range(args.reps):
                ids = prompts(tok, vocab, length, static, 1000 * length + rep)
                order: list[Any] = ["dense", *sparse_runs] if rep % 2 == 0 else \
                    [*sparse_runs, "dense"]
                got = {key: serve(engine, ids, 0 if key != "dense" and key[1] == "b" else static,
                                  key != "dense", None if key == "dense" else key[0])
                       for key in order}
                for key in sparse_runs:
                    assert got[key]["info"].mode == "specprefill", got[key]["info"]
                    got[key]["kl"] = kl(got["dense"]["logprobs"], got[key]["logprobs"])
                    got[key]["same"] = got["dense"]["answer"] == got[key]["answer"]
                for key in order:
                    runs[key].append(got[key])
            dense = statistics.median(r["ttft"] for r in runs["dense"])
            for keep, variant in sparse_runs:
                done = runs[(keep, variant)]
                sparse = statistics.median(r["ttft"] for r in done)
                row = {"model": name, "tokens": length, "static": static, "keep": keep,
                       "variant": variant, "dense_ttft_s": dense, "sparse_ttft_s": sparse,
                       "speedup": dense / sparse,
                       "kept": statistics.median(r["info"].kept_tokens for r in done),
                       "kl": statistics.median(r["kl"] for r in done),
                       "kl_mean": statistics.mean(r["kl"] for r in done),
                       "same_answers": sum(r["same"] for r in done), "reps": args.reps}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    return rows


VARIANT_NAMES = {"d": "cached boundary (static prefix dense)", "b": "no boundary"}


def table(rows: list[dict[str, Any]], command: str, keep: Any) -> str:
    from engine import machine

    lines = ["| model | prompt tokens | static prefix | SpecPrefill | keep | dense TTFT (s) | "
             "SpecPrefill TTFT (s) | dense / SpecPrefill | tokens kept after the static "
             "prefix | KL(dense, SpecPrefill), first token: median / mean | greedy "
             f"{ANSWER_TOKENS} tokens = dense |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']:,} | {r.get('static', 0):,} | "
                     f"{VARIANT_NAMES[r.get('variant', 'd')]} | {r.get('keep', keep):.0%} | "
                     f"{r['dense_ttft_s']:.2f} | {r['sparse_ttft_s']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['kept']:,.0f} | {r['kl']:.4f} / "
                     f"{r.get('kl_mean', r['kl']):.4f} | {r['same_answers']}/{r['reps']} |")
    return ("\n".join(lines) + f"\n\nCommand: `{command}`. Machine: {machine()}; shared with "
            "other engineers' builds and tests while it ran (a loaded 2-core machine: compare "
            "within a row).")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """The quality/TTFT frontier: KL to dense against the TTFT speedup, one point per row,
    a line per (length, variant) through its keep shares (matplotlib: the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["tokens"], r.get("variant", "d")), []).append(r)
    for (tokens, variant), pts in sorted(groups.items()):
        pts.sort(key=lambda r: r["keep"])
        ax.plot([r["speedup"] for r in pts], [r["kl"] for r in pts], marker="o",
                linestyle="-" if variant == "d" else "--",
                label=f"{tokens:,} tokens, {VARIANT_NAMES[variant]}")
        for r in pts:
            ax.annotate(f"keep {r['keep']:.0%}", (r["speedup"], r["kl"]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("TTFT speedup over dense (x)")
    ax.set_ylabel("KL(dense || SpecPrefill), first token (nats)")
    ax.set_title(f"SpecPrefill on {rows[0]['model']}: quality against time to first token",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="gemma3_text,gpt_oss,qwen3_next,qwen3_5")
    ap.add_argument("--model", type=Path, help="a real model folder (needs --draft), or "
                                               "'gemma' for Gemma 3 270M (real weights)")
    ap.add_argument("--draft", type=Path, help="its draft model folder (same vocabulary)")
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--static", type=int, default=1024)
    ap.add_argument("--keep", default="0.3", help="keep shares, comma-separated")
    ap.add_argument("--variants", default="d",
                    help="d: the static prefix kept dense (the cached boundary); b: no "
                         "boundary (default d)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=3,
                    help="with --model gemma: the draft is its first N layers (default 3)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path, help="no run: the table (and --plot) of rows an "
                                                   "earlier run wrote with --json")
    ap.add_argument("--plot", type=Path, help="also draw the frontier (an .svg or .png)")
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    if args.from_json:
        rows = json.loads(args.from_json.read_text())
        print(table(rows, "bash bench/hybrid_specprefill.sh " + " ".join(sys.argv[1:]), args.keep))
        if args.plot:
            plot(rows, args.plot)
        return
    from mlx_lm import load
    from mlx_lm.utils import load_model

    from engine_adapter.testing.tiny_model import tiny_model_folder

    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if str(args.model) == "gemma":
        from engine_adapter.gemma_model import gemma_model_dir

        args.model = gemma_model_dir()
        args.draft = args.draft or gemma_model_dir(layers=args.draft_layers)
    if args.model:
        if not args.draft:
            raise SystemExit("--model needs --draft (a smaller model of the same vocabulary)")
        model, wrapper = load(str(args.model))[:2]
        draft = load(str(args.draft))[0]
        rows += measure(args.model.name, model, draft, wrapper._tokenizer, args)
    else:
        root = Path(tempfile.mkdtemp(prefix="hybrid-bench-"))
        draft = load_model(tiny_model_folder(root / "draft", "qwen3", hidden=32, layers=1,
                                             heads=2, kv_heads=1))[0]
        for arch in args.families.split(","):
            model = load_model(tiny_model_folder(root / arch, arch, **SHAPE))[0]
            rows += measure(f"tiny {arch}", model, draft, None, args)
    command = "bash bench/hybrid_specprefill.sh " + " ".join(sys.argv[1:])
    text = table(rows, command.strip(), args.keep) + (
        f" Whole run: {time.perf_counter() - started:.0f} s.")
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
    if args.update_docs:
        from engine import update_docs

        marks = (REAL_START, REAL_END) if args.model else (MARK_START, MARK_END)
        update_docs(text, *marks, DOCS)


if __name__ == "__main__":
    main()

"""Whole prompt preparation (render + tokenize + boundary) when the client sends messages, not
ids: a hit of this tree against the uncached paths and against the previous release's hit, side
by side in one process.

    PYTHONPATH=$PWD python bench/prepare.py [--base 870bc76] [--requests 20] [--passes 3]
                                            [--tools 16,64] [--output docs/benchmarks-prepare.table.md]

Per template (Qwen3.5-4B, Llama-3.1-8B-Instruct and gpt-oss-120b from ../shared/chat_templates,
each with its real tokenizer built offline) and tool count, the same requests (one agent: fixed
system prompt and tools, a different user turn each) are timed by every method in a freshly
shuffled order per request, medians reported with ratios:

- **this hit**: ``StaticPrefixCache.resolve`` without ids on a warm entry: render the prompt's
  text, tokenize what follows the stored split, cut (default sampled check rate included);
- **previous hit**: the same call on the ``--base`` commit's ``prefix_cache`` (``git archive``,
  imported as ``prefix_cache_base``): render and tokenize the whole prompt, cut;
- **uncached two-probe**: what an engine does without the cache, as the issue names it: render
  and tokenize the prompt and the two probes, cut;
- **this miss**: this tree's real miss (a fresh namespace per request): render, key, lookup, the
  four probe renders (two probes, two multi-turn probes), the split search, store, tokenize, cut.

Every method must give the same prompt ids and boundary. A second table splits a hit's render:
transformers' render (``apply_chat_template(tokenize=False)``), the direct render without the
defensive copy of the plain tools, a hit's render (no copy, the tools' ``tojson`` texts of its
key reused), that copy alone (``_plain_template_data``), the tools' ``tojson`` alone (with the
template's ``indent``), and the tokenization of the whole text against the tail only.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT.parent / "shared" / "chat_templates"
CASES = (("Qwen3.5-4B", "qwen3.5"), ("Llama-3.1-8B", "llama3.1"), ("gpt-oss-120b", "gpt-oss"))
STEMS = {"Qwen3.5-4B": "Qwen3.5-4B", "Llama-3.1-8B": "meta-llama-Llama-3.1-8B-Instruct",
         "gpt-oss-120b": "openai-gpt-oss-120b"}
DEFAULT_BASE = "870bc76"  # main before issue #13: hits render and tokenize the whole prompt
METHODS = ("hit", "previous", "two_probe", "miss")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def run_case(base: Any, label: str, tok_name: str, n_tools: int, n_requests: int,
             passes: int) -> tuple[str, str]:
    import prefix_cache
    from prefix_cache.cache import boundary
    from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    tok = load_offline_tokenizer(tok_name)
    template = (TEMPLATES / f"{STEMS[label]}.jinja").read_text()
    tools = bench_tools(n_tools)
    system = {"role": "system", "content": SYSTEM_PROMPT}

    def apply(messages: list[dict[str, Any]]) -> list[int]:
        return list(tok.apply_chat_template(messages, tools=tools, chat_template=template,
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False))

    def two_probe(messages: list[dict[str, Any]]) -> tuple[list[int], int]:
        ids = apply(messages)
        return ids, boundary.system_end(ids, boundary.static_prefix_ids(apply, [system]))

    this = prefix_cache.StaticPrefixCache()
    previous = base.StaticPrefixCache()
    warm = [system, {"role": "user", "content": "Warm up."}]
    this.resolve(tok, warm, tools, chat_template=template)
    previous.resolve(tok, warm, tools, chat_template=template)
    requests = [[system, {"role": "user", "content": f"Request {i}: fix the failing test in "
                                                     f"module_{i}.py and explain the change."}]
                for i in range(n_requests)]
    methods: dict[str, Callable[[list[dict[str, Any]], int], tuple[list[int], int]]] = {
        "hit": lambda m, _: _ids(this.resolve(tok, m, tools, chat_template=template)),
        "previous": lambda m, _: _ids(previous.resolve(tok, m, tools, chat_template=template)),
        "two_probe": lambda m, _: two_probe(m),
        "miss": lambda m, k: _ids(this.resolve(tok, m, tools, chat_template=template,
                                               namespace=f"miss-{k}")),
    }
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    rng = random.Random(n_tools)
    order = list(METHODS)
    gc.disable()
    try:
        for p in range(passes):
            for i, messages in enumerate(requests):
                rng.shuffle(order)
                answers = {}
                for name in order:
                    call = methods[name]
                    k = p * n_requests + i
                    seconds, answers[name] = timed(lambda c=call, m=messages, k=k: c(m, k))
                    times[name].append(seconds)
                if len({json.dumps(a) for a in answers.values()}) != 1:
                    raise SystemExit(f"{label}, {n_tools} tools: the methods disagree")
            gc.collect()
    finally:
        gc.enable()
    snap = this.stats.snapshot()
    if snap["hits"] and not snap["fast_tokenizations"]:
        raise SystemExit(f"{label}, {n_tools} tools: no hit took the fast path")
    med = {name: statistics.median(times[name]) for name in METHODS}
    end = answers["hit"][1]
    row = (f"| {label} | {n_tools} | {len(answers['hit'][0])} | {end} | {fmt(med['hit'])} | "
           f"{fmt(med['previous'])} | {fmt(med['two_probe'])} | {fmt(med['miss'])} | "
           f"**{med['previous'] / med['hit']:.1f}x** | **{med['two_probe'] / med['hit']:.1f}x** | "
           f"**{med['miss'] / med['hit']:.1f}x** |")
    return row, breakdown(label, tok, template, tools, requests[0], this)


def _ids(result: Any) -> tuple[list[int], int]:
    return list(result.prompt_ids), result.specprefill_system_end


def breakdown(label: str, tok: Any, template: str, tools: list[dict[str, Any]],
              messages: list[dict[str, Any]], cache: Any) -> str:
    """Where a hit's time goes: the render's parts and the tokenization, medians of 30."""
    from transformers.utils.chat_template_utils import _plain_template_data

    from prefix_cache.cache._plan import make_plan
    from prefix_cache.cache.entry import decode_entry
    from prefix_cache.cache.keys import KeyPacker
    from prefix_cache.fastpath import FastPromptText

    fast = FastPromptText()
    plan = make_plan(tok, messages, tools, None, template, "default", None, prefix=cache.prefix,
                     protect_default_prefix=False, renderers=cache._renderers,
                     packer=KeyPacker())
    renderer, compiled, memo_key = plan.renderer, fast.compile(plan.renderer), (plan.key, plan.check)
    entry = decode_entry(cache.store.get(plan.key), plan.key, plan.check)
    text = fast.render(plan, messages, tools)
    indent = 4 if "tojson(indent=4)" in template else None
    parts = {
        "transformers render": lambda: renderer.render_text(messages, tools, {}),
        "without the copy": lambda: fast.render_direct(compiled, plan, messages, tools, None,
                                                       False),
        "a hit's render": lambda: fast.render_direct(compiled, plan, messages, tools, memo_key,
                                                     False),
        "the copy alone": lambda: _plain_template_data(tools),
        "tojson alone": lambda: [json.dumps(t, ensure_ascii=False, indent=indent) for t in tools],
        "tokenize the whole text": lambda: renderer.tokenize(text),
        "tokenize from the split": lambda: renderer.tokenize(text[entry.split.anchor:]),
    }
    cells = [fmt(statistics.median(timed(fn)[0] for _ in range(30))) for fn in parts.values()]
    tail = len(text) - entry.split.anchor
    return f"| {label} | {len(tools)} | " + " | ".join(cells) + f" | {tail} of {len(text)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=DEFAULT_BASE, help="the commit whose hit is 'previous'")
    parser.add_argument("--requests", type=int, default=20, help="distinct requests per row")
    parser.add_argument("--passes", type=int, default=3, help="passes over them per row")
    parser.add_argument("--tools", default="16,64", help="tool counts, comma-separated")
    parser.add_argument("--output", help="also write the markdown tables here")
    args = parser.parse_args()
    if not TEMPLATES.is_dir():
        raise SystemExit(f"needs the real templates at {TEMPLATES}")
    sys.path.insert(0, str(ROOT / "bench"))
    from hit_ab import import_base

    from prefix_cache.testing.benchmark import machine

    rows, parts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        base = import_base(args.base, Path(tmp))
        for label, tok_name in CASES:
            for n in (int(t) for t in args.tools.split(",")):
                row, part = run_case(base, label, tok_name, n, args.requests, args.passes)
                rows.append(row)
                parts.append(part)
                print(row, file=sys.stderr)
    command = ("PYTHONPATH=$PWD python bench/prepare.py --base " + args.base
               + f" --requests {args.requests} --passes {args.passes} --tools {args.tools}")
    out = "\n".join([
        f"Machine: {machine()}. {args.requests} requests x {args.passes} passes per row, methods "
        "interleaved in a shuffled order per request, medians.",
        f"Command: `{command}`",
        "",
        "| template | tools | prompt tokens | boundary | this hit | previous hit | uncached "
        "two-probe | this miss | vs previous hit | vs two-probe | vs miss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Where a hit's time goes (medians of 30 calls):",
        "",
        "| template | tools | transformers render | without the copy | a hit's render (no copy, "
        "tools' tojson reused) | the copy alone | tools' tojson alone | tokenize whole text | "
        "tokenize from the split | tail chars |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *parts,
    ])
    print(out)
    if args.output:
        Path(args.output).write_text(out + "\n")


if __name__ == "__main__":
    main()

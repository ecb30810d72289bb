"""One tree's in-process hit, to be run once per tree, alternating (A/B on a loaded machine):

    for t in $PWD /work/main; do PYTHONPATH=$t python bench/hit_in_process_ab.py $t; done

`resolve` on a memory hit (Qwen3.5 template from ../shared/chat_templates, 64 tools, the qwen3
tokenizer, no sampled checks), without and with the prompt ids given: medians of 300, in us.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def main(tree: str) -> None:
    sys.path.insert(0, tree)
    from prefix_cache import StaticPrefixCache
    from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    tok = load_offline_tokenizer("qwen3")
    template = (Path(__file__).resolve().parents[2] / "shared" / "chat_templates" /
                "Qwen3.5-4B.jinja").read_text(encoding="utf-8")
    tools = bench_tools(64)
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Fix the failing test."}]
    cache = StaticPrefixCache(tokenize_check_rate=0)
    ids = cache.resolve(tok, messages, tools, chat_template=template).prompt_ids
    out: dict[str, float] = {}
    for name, extra in (("rendered", {}), ("prompt_ids", {"prompt_ids": ids})):
        times = []
        for _ in range(300):
            started = time.perf_counter()
            cache.resolve(tok, messages, tools, chat_template=template, **extra)
            times.append(time.perf_counter() - started)
        out[name] = round(statistics.median(times) * 1e6, 1)
    print(json.dumps({"tree": tree, **out}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))

"""Decode after the first token at a 6k-token context (issue 43): our engine in-process
(``MLXEngine``) and over HTTP (``prefix-cache serve-engine``) against ``mlx_lm.server``, on the
demo model (SmolLM2-135M-Instruct), the same prompt, greedy, requests alternating between the
three in one run; per request the decoded tokens and tokens/s from the first token to the last.
Ratios are taken per round (ours / mlx_lm.server, the same minute of machine load).

    bench/decode_6k.sh [--context 6000] [--max-tokens 128] [--repeats 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from engine import free_port, machine  # noqa: E402

QUESTION = "Rewrite the notes above as a long, detailed report, section by section."


def document(tok: Any, tokens: int) -> list[dict[str, str]]:
    """Chat messages whose rendered prompt is about ``tokens`` long: numbered notes, then a
    request for a long answer (so greedy decoding runs to ``max_tokens``)."""
    notes: list[str] = []
    messages: list[dict[str, str]] = []
    while True:
        i = len(notes)
        notes.append(f"Note {i}: service {i % 17} restarted {i % 5} times on day {i % 31}; "
                     f"the queue held {37 * i % 1000} jobs and worker {i % 9} was slow.")
        messages = [{"role": "system", "content": "You are a careful operations analyst."},
                    {"role": "user", "content": "\n".join(notes) + "\n\n" + QUESTION}]
        if i % 20 == 0 and len(tok.apply_chat_template(messages, add_generation_prompt=True)) \
                >= tokens:
            return messages


def start(argv: list[str], url: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A server process, once it answers ``/v1/models``."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    for _ in range(1200):
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=1).read()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[2]} exited") from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{argv[2]} did not start")


def over_http(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[int, float, str]:
    """(decoded tokens, tokens/s after the first, text) of one streamed greedy request."""
    body = {"model": "default_model", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    first = last = None
    n, text = -1, []
    with urllib.request.urlopen(request, timeout=1200) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    text.append(delta)
    assert first is not None and last is not None and n > 1
    return n, (n - 1) / (last - first), "".join(text)


def in_process(engine: Any, tok: Any, ids: list[int], max_tokens: int) -> tuple[int, float, str]:
    """(decoded tokens, tokens/s after the first, text) of one greedy request on ``engine``."""
    from engine_adapter.mlx_engine import GenerationRequest

    times, tokens = [], []
    for event in engine.generate(GenerationRequest(ids, max_tokens=max_tokens)):
        times.append(time.perf_counter())
        tokens.append(event.token)
    stops = set(tok.eos_token_ids)
    return len(tokens), (len(tokens) - 1) / (times[-1] - times[0]), \
        tok.decode([t for t in tokens if t not in stops])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=6000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    from mlx_lm import load

    from engine_adapter.demo_model import demo_chat_model_dir
    from engine_adapter.mlx_engine import MLXEngine

    model_dir = demo_chat_model_dir()
    model, tok = load(str(model_dir))[:2]
    messages = document(tok, args.context)
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ours_port, theirs_port = free_port(), free_port()
    ours_url, theirs_url = f"http://127.0.0.1:{ours_port}", f"http://127.0.0.1:{theirs_port}"
    home = tempfile.mkdtemp(prefix="decode6k-")
    procs = [
        start([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port",
               str(theirs_port), "--log-level", "WARNING"], theirs_url, env),
        start([sys.executable, "-m", "prefix_cache.cli", "serve-engine", "--model",
               str(model_dir), "--port", str(ours_port)], ours_url,
              {**env, "PREFIX_CACHE_HOME": home}),
    ]
    engine = MLXEngine(model, stop_token_ids=sorted(tok.eos_token_ids))
    runs: dict[str, Callable[[], tuple[int, float, str]]] = {
        "mlx_lm.server": lambda: over_http(theirs_url, messages, args.max_tokens),
        "ours in-process": lambda: in_process(engine, tok, ids, args.max_tokens),
        "ours serve-engine": lambda: over_http(ours_url, messages, args.max_tokens),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    ratios: dict[str, list[float]] = {name: [] for name in runs if name != "mlx_lm.server"}
    texts: dict[str, str] = {}
    try:
        for name, go in runs.items():   # warm-up: each prefills the prompt once (cached after)
            texts[name] = go()[2]
        for rep in range(args.repeats):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))
            got = {}
            for name in order:
                n, rate, _ = runs[name]()
                got[name] = rate
                rates[name].append(rate)
                print(f"round {rep} {name}: {n} tokens, {rate:.1f} tok/s", flush=True)
            for name in ratios:
                ratios[name].append(got[name] / got["mlx_lm.server"])
    finally:
        engine.close()
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(home, ignore_errors=True)   # serve-engine's disk tier: the prompt's KV
    load = os.getloadavg()
    print(f"\nprompt {len(ids)} tokens, max_tokens {args.max_tokens}, {args.repeats} rounds; "
          f"{machine()}; load average at the end {load[0]:.1f}/{load[1]:.1f}")
    print("| server | decode tok/s (median) | ratio to mlx_lm.server (median of rounds) | "
          "same text as mlx_lm.server |")
    print("|---|---|---|---|")
    for name in runs:
        ratio = statistics.median(ratios[name]) if name in ratios else 1.0
        same = texts[name] == texts["mlx_lm.server"]
        print(f"| {name} | {statistics.median(rates[name]):.1f} | {ratio:.2f}x | {same} |")


if __name__ == "__main__":
    main()

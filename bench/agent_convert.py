"""What the agent APIs add to a request: converting an Anthropic Messages or OpenAI Responses
body to the chat-template conversation, against the cached boundary of that conversation (a
hit, prompt rendered and tokenized as the sidecar does for a client that sends no ids).

One agent (a system prompt, N tools, T tool round trips), each method timed in a freshly
shuffled order inside one loop; medians and ratios. Real Qwen3 tokenizer (the demo model's).

    PYTHONPATH=$PWD python bench/agent_convert.py [--reps 200] [--turns 20] [--tools 16,64]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from prefix_cache import StaticPrefixCache
from prefix_cache.chat.anthropic_params import parse_messages_body
from prefix_cache.chat.responses_params import parse_responses_body
from prefix_cache.model_folders.demo import demo_model_dir
from prefix_cache.model_folders.model_dir import load_tokenizer

SYSTEM = "You are a careful coding agent. " * 40


def schema(i: int) -> dict[str, Any]:
    return {"type": "object", "properties": {
        "path": {"type": "string", "description": f"Path for tool {i}, relative to the root."},
        "limit": {"type": "integer", "default": 20}}, "required": ["path"]}


def bodies(n_tools: int, turns: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same agent conversation as a Messages body and as a Responses body."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    items: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for t in range(turns):
        args = {"path": f"src/module_{t}.py", "limit": t}
        messages += [
            {"role": "assistant", "content": [
                {"type": "text", "text": f"Step {t}: reading a file."},
                {"type": "tool_use", "id": f"toolu_{t}", "name": f"tool_{t % n_tools}",
                 "input": args}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{t}",
                 "content": f"def f_{t}():\n    return {t}\n" * 5}]}]
        items += [
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": f"Step {t}: reading a file."}]},
            {"type": "function_call", "call_id": f"call_{t}", "name": f"tool_{t % n_tools}",
             "arguments": f'{{"path": "src/module_{t}.py", "limit": {t}}}'},
            {"type": "function_call_output", "call_id": f"call_{t}",
             "output": f"def f_{t}():\n    return {t}\n" * 5}]
    messages[-1]["content"].append({"type": "text", "text": "Go on."})
    items.append({"role": "user", "content": "Go on."})
    anthropic = {"model": "m", "max_tokens": 512, "system": SYSTEM, "messages": messages,
                 "tools": [{"name": f"tool_{i}", "description": f"Tool {i} of the workspace.",
                            "input_schema": schema(i)} for i in range(n_tools)]}
    responses = {"model": "m", "instructions": SYSTEM, "input": items,
                 "tools": [{"type": "function", "name": f"tool_{i}",
                            "description": f"Tool {i} of the workspace.",
                            "parameters": schema(i)} for i in range(n_tools)]}
    return anthropic, responses


def run(n_tools: int, turns: int, reps: int, tokenizer: Any) -> dict[str, float]:
    anthropic, responses = bodies(n_tools, turns)
    conversation = parse_messages_body(anthropic).conversation
    cache = StaticPrefixCache()
    cache.resolve(tokenizer, conversation.messages, conversation.tools)  # warm: every later one hits
    methods: dict[str, Callable[[], Any]] = {
        "messages -> conversation": lambda: parse_messages_body(anthropic),
        "responses -> conversation": lambda: parse_responses_body(responses, lambda _: None),
        "cached boundary (hit, render + tokenize)": lambda: cache.resolve(
            tokenizer, conversation.messages, conversation.tools),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods)
    for _ in range(reps):
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - start)
    cache.close()
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--tools", default="16,64")
    args = parser.parse_args()
    tokenizer = load_tokenizer(demo_model_dir())
    print(f"# {platform.machine()} {platform.processor() or ''} python {platform.python_version()}"
          f", {args.reps} reps, {args.turns} tool round trips")
    print("| tools | method | median | share of the hit |")
    print("|---|---|---|---|")
    for n_tools in (int(t) for t in args.tools.split(",")):
        medians = run(n_tools, args.turns, args.reps, tokenizer)
        hit = medians["cached boundary (hit, render + tokenize)"]
        for name, median in medians.items():
            print(f"| {n_tools} | {name} | {median * 1e3:.3f} ms | {median / hit:.1%} |")


if __name__ == "__main__":
    main()

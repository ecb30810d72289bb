"""A chat loop and an agent tool loop that send the model's replies (and tool results) back,
against mlx_lm.server and vllm-mlx (issue 43): one harness, each server a real process on the
demo chat model (SmolLM2-135M-Instruct, float32), requests alternating between the servers turn by
turn, greedy, so each server's conversation is its own (built from its own replies) and they stay
comparable.

    bash bench/agent_loop.sh [--turns 5] [--max-tokens 48] [--repeats 2] [--update-docs]

Per turn and server: prompt tokens, cached tokens (``usage.prompt_tokens_details.cached_tokens``;
vllm-mlx leaves it out, so its count is read from its log's ``[cache_fetch]`` line; ours also
says, from its ``/metrics``, how many of them it had generated), TTFT (streamed: the first event
with content or a tool call in it) and decode tokens/s after the first token.

- chat loop: a system prompt and a fixed list of user questions; every reply goes back as the
  assistant's message.
- agent tool loop: three tools, a system prompt, and a short earlier exchange in which the agent
  called two tools (a 135M model calls tools only after such an example); then each turn's reply
  goes back with its tool calls, each answered by a tool result from a fixed fake repository;
  a reply without a call is answered by the user's "use a tool" nudge.

Each repeat runs both loops in a new session (its first user message names the session, so
its later turns hit nothing of an earlier repeat but the shared system prompt and tools).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from engine import machine, update_docs  # noqa: E402
from servers import (  # noqa: E402
    Server,
    Streamed,
    mlx_lm_argv,
    ours_argv,
    start_server,
    stream_chat,
    vllm_mlx_argv,
)

DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "agent-loop.svg"
MARK_START, MARK_END = "<!-- bench:agent-loop:start -->", "<!-- bench:agent-loop:end -->"
SERVERS = ("ours", "mlx_lm", "vllm_mlx")
LABELS = {"ours": "ours (serve-engine)", "mlx_lm": "mlx_lm.server", "vllm_mlx": "vllm-mlx"}
VLLM_PYTHON = Path("/work/venv-vllm-mlx/bin/python")
REUSED_GENERATED = "prefix_cache_engine_reused_generated_tokens_total"

CHAT_SYSTEM = "You are a concise, friendly assistant."
CHAT_QUESTIONS = ("Tell me about the history of tea.", "And coffee?", "Which has more caffeine?",
                  "Summarise what you said so far.", "Give me one more fact.",
                  "Thanks, goodbye.")

AGENT_SYSTEM = "You are a coding agent. You act through tools."
FILES = {"src": "main.py util.py config.yaml", "docs": "usage.md api.md",
         "src/main.py": ("from util import load\n\nif __name__ == '__main__':\n"
                         "    load('config.yaml')"),
         "src/util.py": "import yaml\n\ndef load(path):\n    return yaml.safe_load(open(path))",
         "src/config.yaml": "retries: 3\ntimeout_s: 30", "docs/usage.md": "# Usage\nRun `make`."}
AGENT_TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": text,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}}
    for name, text in (("list_dir", "List a folder of the repository."),
                       ("read_file", "Read a file of the repository."),
                       ("grep", "Search the repository for a text."))]
NUDGE = "Use a tool: read the next file."


def _call(call_id: str, name: str, path: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps({"path": path})}}


AGENT_EXAMPLE: list[dict[str, Any]] = [
    {"role": "user", "content": "List the folder docs."},
    {"role": "assistant", "content": "", "tool_calls": [_call("c0", "list_dir", "docs")]},
    {"role": "tool", "tool_call_id": "c0", "content": FILES["docs"]},
    {"role": "assistant", "content": "", "tool_calls": [_call("c1", "read_file", "docs/usage.md")]},
    {"role": "tool", "tool_call_id": "c1", "content": FILES["docs/usage.md"]},
    {"role": "assistant", "content": "docs holds usage.md and api.md; usage.md says to run make."},
]


# -- the two loops -----------------------------------------------------------------------------

def first_messages(loop: str, session: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) of a loop's first turn in session ``session``."""
    if loop == "chat":
        return [{"role": "system", "content": CHAT_SYSTEM},
                {"role": "user", "content": f"(Session {session}.) {CHAT_QUESTIONS[0]}"}], []
    return [{"role": "system", "content": AGENT_SYSTEM}, *AGENT_EXAMPLE,
            {"role": "user", "content": f"(Session {session}.) Now list the folder src."}], \
        AGENT_TOOLS


def tool_result(call: dict[str, Any]) -> str:
    """The fake repository's answer to one call (a fixed function of the call)."""
    try:
        path = str(json.loads(call["function"]["arguments"] or "{}").get("path", ""))
    except (json.JSONDecodeError, AttributeError):
        return "error: the arguments are not a JSON object"
    return FILES.get(path.strip("/"), f"error: no such file or folder: {path}")


def next_messages(loop: str, messages: list[dict[str, Any]], reply: Streamed,
                  turn: int) -> list[dict[str, Any]]:
    """The conversation after ``reply``: the reply as the assistant's message, then the next
    user question (chat), or a tool result per call, or the nudge (agent)."""
    calls = [{**c, "id": c["id"] or f"call_{turn}_{i}"} for i, c in enumerate(reply.tool_calls)]
    assistant: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if calls:
        assistant["tool_calls"] = calls
    out = [*messages, assistant]
    if loop == "chat":
        return out + [{"role": "user",
                       "content": CHAT_QUESTIONS[(turn + 1) % len(CHAT_QUESTIONS)]}]
    if not calls:
        return out + [{"role": "user", "content": NUDGE}]
    return out + [{"role": "tool", "tool_call_id": c["id"], "content": tool_result(c)}
                  for c in calls]


# -- what each server says about its cache -----------------------------------------------------

VLLM_FETCH = re.compile(r"\[cache_fetch\] request=\S+ (HIT|MISS) prompt_tokens=(\d+)"
                        r"(?: cached=(\d+))?")


def vllm_cached(log_text: str) -> int | None:
    """The cached tokens of the last request vllm-mlx logged (its usage leaves them out)."""
    hits = VLLM_FETCH.findall(log_text)
    if not hits:
        return None
    kind, _, cached = hits[-1]
    return int(cached) if kind == "HIT" else 0


def counter(url: str, name: str) -> float:
    """A counter's total over its labels in a Prometheus text exposition."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@dataclass
class Turn:
    """One request's figures."""

    loop: str
    server: str
    repeat: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    generated_reused: int | None     # ours: of the cached tokens, ones it had generated
    completion_tokens: int
    ttft_s: float
    decode_tok_s: float | None
    tool_calls: int


def measure(server: Server, loop: str, rep: int, turn: int, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]], max_tokens: int) -> tuple[Turn, Streamed]:
    before = counter(server.url, REUSED_GENERATED) if server.name == "ours" else 0.0
    body: dict[str, Any] = {"model": server.model, "messages": messages,
                            "max_tokens": max_tokens, "temperature": 0.0}
    if tools:
        body["tools"] = tools
    reply = stream_chat(server.url, body)
    cached = reply.cached_tokens
    if server.name == "vllm_mlx":
        cached = vllm_cached(server.log_text())
    generated = (int(counter(server.url, REUSED_GENERATED) - before)
                 if server.name == "ours" else None)
    ttft = reply.ttft_s if reply.ttft_s is not None else reply.total_s
    return Turn(loop, server.name, rep, turn, int(reply.usage.get("prompt_tokens", -1)), cached,
                generated, int(reply.usage.get("completion_tokens", -1)), ttft,
                reply.decode_tok_s(), len(reply.tool_calls)), reply


# -- the run -----------------------------------------------------------------------------------

def start_all(args: argparse.Namespace, logs: Path, servers: dict[str, Server]) -> dict[str, str]:
    """Start the servers asked for into ``servers``, one after another; a server that fails to
    start is left out: its reason is returned."""
    from engine_adapter.demo_model import demo_chat_model_dir

    model_dir = demo_chat_model_dir()
    argvs = {"ours": ours_argv(kv_disk_dir=logs / "ours-kv"),
             "mlx_lm": mlx_lm_argv(model_dir),
             "vllm_mlx": vllm_mlx_argv(args.vllm_python, model_dir)}
    failed = {}
    for name in args.servers:
        if name == "vllm_mlx" and not args.vllm_python.exists():
            failed[name] = f"no vllm-mlx venv at {args.vllm_python}"
            continue
        try:
            # vllm-mlx saves its prefix cache under ~/.cache and loads it at start: a fresh
            # HOME keeps an earlier run's KV out, as the fresh kv_disk_dir does for ours.
            env = {"HOME": str(logs / "vllm-home")} if name == "vllm_mlx" else None
            servers[name] = start_server(name, argvs[name], logs / f"{name}.log", env)
        except RuntimeError as exc:
            failed[name] = str(exc)
    return failed


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="agent-loop-"))
    servers: dict[str, Server] = {}
    rows: list[Turn] = []
    try:
        failed = start_all(args, logs, servers)
        for server in servers.values():   # warm-up, untimed: kernels, the first compiles
            stream_chat(server.url, {"model": server.model, "max_tokens": 4, "temperature": 0.0,
                                     "messages": [{"role": "user", "content": "Say hello."}]})
        for rep in range(args.repeats):
            for loop in args.loops:
                session = rep + 1
                conversations = {name: first_messages(loop, session) for name in servers}
                for turn in range(args.turns):
                    names = list(servers)
                    shift = (turn + rep) % len(names)
                    for name in names[shift:] + names[:shift]:   # no fixed position
                        messages, tools = conversations[name]
                        row, reply = measure(servers[name], loop, rep, turn, messages, tools,
                                             args.max_tokens)
                        rows.append(row)
                        conversations[name] = (next_messages(loop, messages, reply, turn), tools)
                        if args.verbose:
                            print(row, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return {"machine": machine(), "command": args.command, "turns": args.turns,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "loops": args.loops,
            "servers": list(servers), "failed": failed, "logs": str(logs),
            "rows": [asdict(r) for r in rows]}


# -- the report --------------------------------------------------------------------------------

def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def cell(rows: list[dict[str, Any]]) -> str:
    """prompt / cached (generated) / TTFT / decode tok/s of one server's turn over repeats."""
    if not rows:
        return "-"
    cached = [r["cached_tokens"] for r in rows if r["cached_tokens"] is not None]
    generated = [r["generated_reused"] for r in rows if r["generated_reused"] is not None]
    decode = _median([r["decode_tok_s"] for r in rows if r["decode_tok_s"] is not None])
    calls = sum(r["tool_calls"] > 0 for r in rows)
    return (f"{statistics.median(r['prompt_tokens'] for r in rows):.0f} / "
            + (f"{statistics.median(cached):.0f}" if cached else "n/a")
            + (f" ({statistics.median(generated):.0f})" if generated else "")
            + f" / {statistics.median(r['ttft_s'] for r in rows) * 1000:.0f} ms / "
            + (f"{decode:.1f}" if decode is not None else "-")
            + (f" / tool call {calls}/{len(rows)}" if calls else ""))


def paired_ratio(rows: list[dict[str, Any]], other: str, loop: str, turn: int) -> str:
    """Median over repeats of other's TTFT / ours on the same turn (> 1: ours is faster)."""
    by = {(r["server"], r["repeat"]): r["ttft_s"] for r in rows
          if r["loop"] == loop and r["turn"] == turn}
    ratios = [by[(other, rep)] / by[("ours", rep)] for (server, rep) in by
              if server == other and ("ours", rep) in by]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def table(report: dict[str, Any]) -> str:
    rows, names = report["rows"], report["servers"]
    others = [n for n in names if n != "ours"]
    lines = [f"Machine: {report['machine']}; shared with other engineers' test runs while it "
             f"ran (a loaded 2-core machine: read the ratios, not the milliseconds).",
             f"Command: `{report['command']}`.",
             f"{report['repeats']} repeat(s) of {report['turns']} turns per loop, replies of at "
             f"most {report['max_tokens']} tokens, greedy; servers alternating turn by turn in a "
             f"rotating order. Cells: prompt tokens / cached tokens (ours: of them, generated "
             f"by it) / TTFT / decode tok/s after the first token (/ how many of the replies "
             f"were a tool call), medians over repeats. Ratios: the other server's TTFT / ours "
             f"on the same turn of the same repeat, median (min-max): above 1, ours is faster."]
    for name, why in report["failed"].items():
        lines.append(f"{LABELS[name]} did not run: {why}.")
    if "vllm_mlx" in names:
        lines.append("vllm-mlx reports no cached tokens in its usage: its column's come from its "
                     "log's `[cache_fetch]` line.")
    for loop in report["loops"]:
        lines += ["", f"**{loop} loop**", "",
                  "| turn | " + " | ".join(LABELS[n] for n in names) + " | "
                  + " | ".join(f"TTFT {LABELS[n]} / ours" for n in others) + " |",
                  "|---:|" + "---|" * len(names) + "---:|" * len(others)]
        for turn in range(report["turns"]):
            here = [r for r in rows if r["loop"] == loop and r["turn"] == turn]
            lines.append(f"| {turn + 1} | "
                         + " | ".join(cell([r for r in here if r["server"] == n]) for n in names)
                         + " | " + " | ".join(paired_ratio(rows, n, loop, turn) for n in others)
                         + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Median TTFT per turn, a line per server, a panel per loop."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loops = report["loops"]
    fig, axes = plt.subplots(1, len(loops), figsize=(5 * len(loops), 4), squeeze=False)
    for ax, loop in zip(axes[0], loops, strict=True):
        for name in report["servers"]:
            turns = range(report["turns"])
            ys = [_median([r["ttft_s"] * 1000 for r in report["rows"] if r["loop"] == loop
                           and r["server"] == name and r["turn"] == t]) for t in turns]
            ax.plot([t + 1 for t in turns], ys, "o-", label=LABELS[name])
        ax.set_title(f"{loop} loop: TTFT per turn (median of {report['repeats']})")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT, ms (CPU, shared machine)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--loops", type=lambda s: s.split(","), default=["chat", "agent"])
    parser.add_argument("--servers", type=lambda s: s.split(","), default=list(SERVERS))
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON,
                        help=f"the python of vllm-mlx's own venv (default {VLLM_PYTHON})")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--from-json", type=Path, help="table and plot from an earlier run")
    parser.add_argument("--update-docs", action="store_true",
                        help=f"write the table into {DOCS.relative_to(ROOT)} and the plot to "
                             f"{PLOT.relative_to(ROOT)}")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if set(args.loops) - {"chat", "agent"} or set(args.servers) - set(SERVERS) or \
            "ours" not in args.servers:
        parser.error(f"loops are chat,agent; servers of {','.join(SERVERS)}, ours among them")
    if args.from_json:
        report = json.loads(args.from_json.read_text(encoding="utf-8"))
    else:
        args.command = "bash bench/agent_loop.sh" + "".join(f" {a}" for a in
                                                            (argv or sys.argv[1:]))
        started = time.perf_counter()
        report = run(args)
        report["seconds"] = time.perf_counter() - started
        if args.json:
            args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    text = table(report) + f"\nWhole run: {report['seconds']:.0f} s.\n"
    print(text)
    if args.update_docs:
        update_docs(text, MARK_START, MARK_END, DOCS)
        plot(report, PLOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())

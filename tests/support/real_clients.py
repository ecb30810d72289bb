"""The three agent clients people run, as their users configure them (docs/agent-clients.md):
Claude Code (Anthropic Messages), Codex (OpenAI Responses) and opencode (chat completions),
installed pinned from the npm registry into a project-local prefix, each run non-interactively
in a network namespace that reaches nothing but the sidecar (``netns_forward.py``).

``PREFIX_CACHE_AGENT_CLIENTS`` names the prefix (default: ~/.cache/prefix-cache/agent-clients;
``.ci/run`` installs there where node exists).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .netns_forward import UnixToTcp

PINS = ("@anthropic-ai/claude-code@2.1.332", "@openai/codex@0.171.0", "opencode-ai@1.18.33")
PREFIX = Path(os.environ.get("PREFIX_CACHE_AGENT_CLIENTS",
                             Path.home() / ".cache" / "prefix-cache" / "agent-clients"))
FORWARD = Path(__file__).with_name("netns_forward.py")
CLIENT_TIMEOUT_S = 240.0   # a tool loop of three turns; on the engine each turn prefills ~14k
API_KEY = "sk-agent-clients"
# Every client's own switches against traffic of its own (telemetry, updates, model lists),
# set even inside the namespace so that nothing waits on a connection that cannot succeed.
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "NO_UPDATE_NOTIFIER": "1",
}


def binary(name: str) -> Path | None:
    path = PREFIX / "node_modules" / ".bin" / name
    return path if path.exists() else None


def missing() -> str | None:
    """Why the clients cannot run here, or None."""
    if shutil.which("node") is None:
        return "node is not installed: the real agent clients cannot run"
    absent = [n for n in ("claude", "codex", "opencode") if binary(n) is None]
    if absent:
        return (f"agent clients {absent} are not installed under {PREFIX} "
                f"(npm install --prefix {PREFIX} {' '.join(PINS)})")
    return None


@cache
def netns() -> bool:
    """Whether this machine lets a process take a network namespace of its own."""
    try:
        return subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# -- each client's configuration, as docs/agent-clients.md gives it --------------------------


def claude_setup(home: Path, base_url: str, model: str) -> tuple[list[str], dict[str, str]]:
    return (["claude", "-p", "--output-format", "stream-json", "--verbose"],
            {"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": API_KEY,
             "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model})


def codex_setup(home: Path, base_url: str, model: str) -> tuple[list[str], dict[str, str]]:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(f"""\
model = "{model}"
model_provider = "prefix-cache"

[model_providers.prefix-cache]
name = "prefix-cache"
base_url = "{base_url}/v1"
env_key = "SIDECAR_API_KEY"
wire_api = "responses"
""")
    return (["codex", "exec", "--json", "--skip-git-repo-check"],
            {"SIDECAR_API_KEY": API_KEY, "CODEX_HOME": str(home / ".codex")})


def opencode_setup(home: Path, base_url: str, model: str) -> tuple[list[str], dict[str, str]]:
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    (config / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"prefix-cache": {
            "npm": "@ai-sdk/openai-compatible", "name": "prefix-cache",
            "options": {"baseURL": f"{base_url}/v1", "apiKey": API_KEY},
            "models": {model: {"name": model}}}},
        "model": f"prefix-cache/{model}", "autoupdate": False, "share": "disabled"}, indent=2))
    return ["opencode", "run", "--format", "json"], {}


SETUPS: dict[str, Callable[[Path, str, str], tuple[list[str], dict[str, str]]]] = {
    "claude": claude_setup, "codex": codex_setup, "opencode": opencode_setup}
API = {"claude": "messages", "codex": "responses", "opencode": "chat"}


@dataclass
class ClientRun:
    name: str
    returncode: int
    events: list[dict[str, Any]]   # the client's JSON lines
    stderr: str

    def answer(self) -> str:
        """The client's final text."""
        if self.name == "claude":
            return next((e.get("result") or "" for e in self.events if e["type"] == "result"), "")
        if self.name == "codex":
            texts = [e["item"]["text"] for e in self.events if e["type"] == "item.completed"
                     and e["item"].get("type") == "agent_message"]
        else:
            texts = [e["part"]["text"] for e in self.events if e["type"] == "text"]
        return texts[-1] if texts else ""

    def tools_run(self) -> list[str]:
        """What each tool the client ran returned (its output, as the client shows it)."""
        if self.name == "claude":
            return [str(b.get("content")) for e in self.events if e["type"] == "user"
                    for b in e["message"]["content"]
                    if isinstance(b, dict) and b.get("type") == "tool_result"]
        if self.name == "codex":
            return [e["item"].get("aggregated_output", "") for e in self.events
                    if e["type"] == "item.completed"
                    and e["item"].get("type") == "command_execution"]
        return [str(e["part"]["state"].get("output")) for e in self.events
                if e["type"] == "tool_use" and e["part"]["state"].get("status") == "completed"]

    def usage(self) -> tuple[int, int]:
        """(prompt tokens in all, of them read from a cache), summed over the loop's turns as
        the client counts them."""
        if self.name == "claude":
            u = next(e["usage"] for e in self.events if e["type"] == "result")
            cached = u.get("cache_read_input_tokens") or 0
            return (u["input_tokens"] + cached + (u.get("cache_creation_input_tokens") or 0),
                    cached)
        if self.name == "codex":
            u = [e["usage"] for e in self.events if e["type"] == "turn.completed"][-1]
            return u["input_tokens"], u.get("cached_input_tokens") or 0
        steps = [e["part"]["tokens"] for e in self.events if e["type"] == "step_finish"]
        cached = sum(t["cache"]["read"] for t in steps)
        return sum(t["input"] for t in steps) + cached, cached


def run_client(name: str, url: str, model: str, prompt: str, workdir: Path,
               timeout: float = CLIENT_TIMEOUT_S) -> ClientRun:
    """Run client ``name`` once on ``prompt`` in ``workdir`` against the sidecar at ``url``
    (http://127.0.0.1:PORT), in a network namespace of its own where the machine allows one
    (else on its documented switches alone)."""
    home = Path(tempfile.mkdtemp(prefix=f"{name}-home-", dir=workdir.parent))
    command, env_extra = SETUPS[name](home, url, model)
    command = [str(binary(command[0])), *command[1:], prompt]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "LANG": "C.UTF-8", "TERM": "dumb", **QUIET, **env_extra}
    forward = None
    if netns():
        port = int(url.rsplit(":", 1)[1])
        sock = tempfile.mktemp(prefix="pc-ns-", suffix=".sock", dir="/tmp")
        forward = UnixToTcp(sock, port)
        command = ["unshare", "-n", sys.executable, str(FORWARD), str(port), sock, "--",
                   *command]
    try:
        done = subprocess.run(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
        returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as late:  # reported as a failed run, with what it said
        returncode = -9
        stdout, stderr = (_text(late.stdout), f"{_text(late.stderr)}\n(timed out after "
                                               f"{timeout:.0f} s)")
    finally:
        if forward is not None:
            forward.close()
    events = []
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "type" in event:
            events.append(event)
    return ClientRun(name, returncode, events, stdout[-3000:] + stderr)


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")

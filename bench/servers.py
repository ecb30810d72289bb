"""OpenAI-compatible servers as real processes, and one streamed chat request timed, for the
benchmarks that compare our engine with mlx_lm.server and vllm-mlx side by side.

    server = start_server("mlx_lm.server", mlx_lm_argv(model_dir), log_path)
    streamed = stream_chat(server.url, {"model": server.model, "messages": [...], ...})
    server.stop()
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the servers' command lines (each takes the port it listens on) ----------------------------

def mlx_lm_argv(model_dir: Path) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--host",
            "127.0.0.1", "--log-level", "WARNING"]


def ours_argv(model_dir: Path | None = None, kv_disk_dir: Path | None = None) -> list[str]:
    """``prefix-cache serve-engine``; no ``model_dir``: the demo chat model; ``kv_disk_dir``:
    its disk tier's folder (a fresh one keeps an earlier run's KV out)."""
    return [sys.executable, "-m", "prefix_cache.cli", "serve-engine", "--host", "127.0.0.1",
            *(["--model", str(model_dir)] if model_dir else []),
            *(["--engine-option", f"kv_disk_dir={kv_disk_dir}"] if kv_disk_dir else [])]


def vllm_mlx_argv(python: Path, model_dir: Path) -> list[str]:
    """vllm-mlx from its own venv (``python``), continuous batching, its prefix cache on, tool
    calls parsed in the ``<tool_call>{json}</tool_call>`` format (hermes)."""
    return [str(python), "-m", "vllm_mlx.cli", "serve", str(model_dir), "--host", "127.0.0.1",
            "--continuous-batching", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@dataclass
class Server:
    """A started server: its process, base URL, model id (what ``/v1/models`` lists first) and
    the file its stdout and stderr go to."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    model: str
    log_path: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


def start_server(name: str, argv: list[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None) -> Server:
    """Start ``argv --port P`` and wait until ``GET /v1/models`` answers."""
    port = free_port()
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 (the child's)
    proc = subprocess.Popen([*argv, "--port", str(port)], stdout=log, stderr=log, cwd=ROOT,
                            env={"HF_HUB_OFFLINE": "1", **os.environ, **(env or {})})
    if log_path:
        log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        model = served_model(url)
        if model is not None:
            return Server(name, proc, url, model, log_path or Path(os.devnull))
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}"
                               + (f"; its log: {log_path}" if log_path else ""))
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{name} did not answer within {START_TIMEOUT_S:.0f} s")


def served_model(url: str) -> str | None:
    """The first model ``GET /v1/models`` lists; "default_model" when the server answers
    without a list (mlx_lm.server lists its Hugging Face cache, and fails where there is none);
    None while it does not answer."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=1) as response:
            return str(json.loads(response.read())["data"][0]["id"])
    except (urllib.error.HTTPError, ValueError, LookupError, TypeError):
        return "default_model"
    except OSError:
        return None


# -- one streamed request ----------------------------------------------------------------------

@dataclass
class Streamed:
    """What one streamed chat completion gave, timed at the client from the request's start."""

    first_event_s: float | None = None   # the first ``data:`` event of any kind
    ttft_s: float | None = None          # the first event with content or a tool call in it
    total_s: float = 0.0
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)   # merged by index
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    token_events: int = 0                # events with content or a tool call in them

    @property
    def cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens``; None where the server leaves it out."""
        details = self.usage.get("prompt_tokens_details") or {}
        return details.get("cached_tokens") if isinstance(details, dict) else None

    def decode_tok_s(self) -> float | None:
        """Generated tokens after the first, per second after the first one arrived; None when
        they did not stream (a server holding a tool call back sends it whole at the end)."""
        n = self.usage.get("completion_tokens")
        if not n or n < 2 or self.ttft_s is None or self.token_events < n // 2:
            return None
        return (n - 1) / (self.total_s - self.ttft_s)


def merge_tool_call(calls: list[dict[str, Any]], delta: dict[str, Any]) -> None:
    """Fold one streamed ``tool_calls`` delta into ``calls`` (OpenAI's rule: the arguments
    arrive in pieces under one index; id and name once)."""
    index = delta.get("index", len(calls))
    while len(calls) <= index:
        calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call, fn = calls[index], delta.get("function") or {}
    call["id"] = call["id"] or delta.get("id") or ""
    call["function"]["name"] = call["function"]["name"] or fn.get("name") or ""
    call["function"]["arguments"] += fn.get("arguments") or ""


def stream_chat(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> Streamed:
    """POST ``body`` to ``url``/v1/chat/completions as a stream (usage asked for) and read it."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    out, parts = Streamed(), list[str]()
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue  # keep-alive comments while the prompt is processed
            now = time.perf_counter() - started
            out.first_event_s = out.first_event_s if out.first_event_s is not None else now
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            out.usage = chunk.get("usage") or out.usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    out.ttft_s = out.ttft_s if out.ttft_s is not None else now
                    out.token_events += 1
                parts.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or []:
                    merge_tool_call(out.tool_calls, call)
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
    out.total_s = time.perf_counter() - started
    out.text = "".join(parts)
    return out

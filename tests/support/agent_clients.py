"""The requests the agent command-line clients send at their defaults, written from what they
send (issue 54): Claude Code's Anthropic Messages body and Codex's OpenAI Responses body, with
every field that used to be refused. The recordings of the real clients (tests that run them)
take these shapes' place where node is installed; these stay as the hand-made, lean cases."""

from __future__ import annotations

import inspect
import json
from typing import Any

from .agent_upstream import READ, READ_RESPONSES

BILLING = "x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=sdk-cli; cch=1f2e3;"
SESSION = "4d1c9a52-5b7e-4f31-9d2a-0a9e1c3b7f10"
ENV_BLOCK = ("<env>\nWorking directory: /work/repo\nIs directory a git repo: Yes\n"
             "Platform: linux\nToday's date: 2026-12-06\n</env>")
SHELL = {"type": "function", "name": "shell", "description": "Runs a shell command.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "command": {"type": "array", "items": {"type": "string"}}},
             "required": ["command"], "additionalProperties": False}}
# Codex's multi-agent tools: a namespace (a named group of function tools).
MULTI_AGENT = {"type": "namespace", "name": "multi_agent", "description": "Sub-agents.",
               "tools": [{"type": "function", "name": "spawn_agent",
                          "description": "Start a sub-agent on a task.", "strict": False,
                          "parameters": {"type": "object", "properties": {
                              "task": {"type": "string"}}, "required": ["task"]}},
                         {"type": "function", "name": "close_agent",
                          "description": "Close a sub-agent.", "strict": False,
                          "parameters": {"type": "object", "properties": {
                              "id": {"type": "string"}}, "required": ["id"]}}]}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
DROPPED = "x-prefix-cache-dropped-tools"  # the header naming the hosted tools left out


def claude_code_fields(system: str, env: str = ENV_BLOCK, max_tokens: int = 32000,
                       model: str = "claude-sonnet-4-5") -> dict[str, Any]:
    """Claude Code's first request (its tool list cut to one tool), as a Messages body: its
    system blocks (the per-request billing header first), a user turn, then its environment
    block as a ``system`` message inside ``messages``, and its settings."""
    return {
        "model": model, "max_tokens": max_tokens,
        "system": [{"type": "text", "text": BILLING},
                   {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Use the tools.</system-reminder>"},
                {"type": "text", "text": "Read a.txt.", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": env}],
        "tools": [READ],
        "metadata": {"user_id": json.dumps({"device_id": "d0", "account_uuid": "",
                                            "session_id": SESSION})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


def codex_fields(developer: str, task: str = "Read a.txt.") -> dict[str, Any]:
    """Codex's first request as a Responses body: developer items instead of ``instructions``,
    a function tool, a namespace, the hosted ``web_search``, its settings, no
    ``max_output_tokens``."""
    return {
        "model": "gpt-5-codex",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": developer}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>cwd: /work/repo"
                                               "</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                             "text": task}]}],
        "tools": [SHELL, READ_RESPONSES, MULTI_AGENT, WEB_SEARCH],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": SESSION,
        "client_metadata": {"originator": "codex_exec"},
        "text": {"format": {"type": "text"}},
    }


def create_message(sdk: Any, fields: dict[str, Any]) -> Any:
    """``fields`` sent with the SDK's beta client (``?beta=true``, as Claude Code sends them),
    streamed: the raw response (headers) and the final message."""
    known = ("model", "max_tokens", "system", "messages", "tools", "metadata", "thinking")
    extra = {k: v for k, v in fields.items() if k not in known and k != "stream"}
    with sdk.beta.messages.with_streaming_response.create(
            **{k: fields[k] for k in known if k in fields}, stream=True,
            extra_body=extra) as raw:
        events = [json.loads(line[5:]) for line in raw.iter_lines() if line.startswith("data:")]
    return raw, events


def sdk_fields(method: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` as an SDK method takes them: those it does not name go in ``extra_body``."""
    named = inspect.signature(method).parameters
    extra = {k: v for k, v in fields.items() if k not in named}
    return {**{k: v for k, v in fields.items() if k in named}, "extra_body": extra}

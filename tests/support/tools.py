"""Tool sets of realistic size, as agents send them."""

from __future__ import annotations

from typing import Any


def make_tools(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n distinct OpenAI function tools of realistic size."""
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{seed}_{i}",
                "description": f"Tool number {i}: reads, edits or searches files in the workspace.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Path relative to the root."},
                        "limit": {"type": "integer", "description": "Maximum results.", "default": 20},
                        "recursive": {"type": "boolean"},
                    },
                    "required": ["path"],
                },
            },
        }
        for i in range(n)
    ]

"""Copies of the session's tokenizers that a test may change."""

from __future__ import annotations

from typing import Any


def fresh(tok: Any) -> Any:
    """A new copy of a session tokenizer (from its folder), free to change before first use
    (in-place backend edits after first use are not seen: README, the tokenizer's state)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok.name_or_path, local_files_only=True)

"""The boundary's definition (ARCHITECTURE.md), computed the slow, obvious way over any render:
the reference the cache and the oMLX plug-in are checked against.

Nothing here imports prefix_cache: the point is to recompute the answer another way. ``ids_of``
is the render under test, messages in and the prompt's token ids out (a tokenizer's
``apply_chat_template``, or oMLX's own render and encode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

STATIC = ("system", "developer")
PROBES = ("Hi", "Tell me a joke.")

Messages = list[dict[str, Any]]
IdsOf = Callable[[Messages], Sequence[int]]


def cpl(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def leading_static(messages: Messages) -> Messages:
    """The system and developer messages before the first other one."""
    out = []
    for m in messages:
        if m["role"] not in STATIC:
            break
        out.append(m)
    return out


def two_probe(ids_of: IdsOf, messages: Messages, probe_ids_of: IdsOf | None = None) -> int:
    """The two-probe boundary: where the prompt leaves what two renders of the static messages
    with different user texts share (``probe_ids_of`` renders the probes where they differ from
    the prompt's render, e.g. always with the generation prompt)."""
    static = leading_static(messages)
    if not static or len(static) == len(messages):
        return 0
    probe = probe_ids_of or ids_of
    a = probe([*static, {"role": "user", "content": PROBES[0]}])
    b = probe([*static, {"role": "user", "content": PROBES[1]}])
    return cpl(ids_of(messages), list(a)[: cpl(a, b)])


def first_text_start(ids_of: IdsOf, messages: Messages) -> int:
    """Token index where the first non-static message's content starts: where the prompt leaves
    a render of the same conversation with that content replaced by a text whose first
    character differs."""
    n = len(leading_static(messages))
    first = messages[n]
    content = first.get("content")
    lead = content if isinstance(content, str) else ""
    if isinstance(content, list) and content and isinstance(content[0].get("text"), str):
        lead = content[0]["text"]
    other = PROBES[1] if lead.startswith("H") else PROBES[0]
    return cpl(ids_of(messages), ids_of([*messages[:n], {**first, "content": other}, *messages[n + 1:]]))


def exact(ids_of: IdsOf, messages: Messages, probe_ids_of: IdsOf | None = None) -> int:
    """The contract: the two-probe answer, never past the first non-static message's text."""
    static = leading_static(messages)
    if not static or len(static) == len(messages):
        return 0
    return min(two_probe(ids_of, messages, probe_ids_of), first_text_start(ids_of, messages))

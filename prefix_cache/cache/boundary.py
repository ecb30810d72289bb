"""The two-probe static-prefix computation: pure functions over a render callable.

    static   = leading system/developer messages
    A, B     = render(static + [user PROBE_A]), render(static + [user PROBE_B])
    scaffold = common_prefix_len(A, B)          # ends before any probe text
    boundary = common_prefix_len(prompt_ids, A[:scaffold])

The probes differ in their first token, so the scaffold stops where the user text would start,
whatever the template injected before it (default system block, tools, dates). The boundary is
then cut where the real prompt leaves that scaffold, so it never over-reports.

Some templates lay a longer conversation out differently: Mistral's move the system text into
the last user turn, so a multi-turn prompt has its first user text where the probes have the
system text, and a shared leading word would extend the cut into user text. The cut never
passes the first non-static message's text:

    cap      = common_prefix_len of two multi-turn probes that differ in their first user text
               (computed with the scaffold; on common templates cap >= len(scaffold))
    boundary = the cut, and when the request is not the probes' shape and the cut passes cap,
               at most where its first non-static text starts (``first_text_replaced``)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any
from ..util.prefix_len import common_prefix_len, packed_prefix_len  # noqa: F401 (re-exported)

PROBE_A = "Hi"
PROBE_B = "Tell me a joke."

Message = Mapping[str, Any]
RenderIds = Callable[[list[Message]], list[int]]

def probe_conversations(static: Sequence[Message]) -> tuple[list[Message], list[Message]]:
    """The two probe conversations: the static messages followed by each probe user turn."""
    return (
        [*static, {"role": "user", "content": PROBE_A}],
        [*static, {"role": "user", "content": PROBE_B}],
    )


def static_prefix_ids(render: RenderIds, static: Sequence[Message]) -> list[int]:
    """Token ids of the template's scaffold for these static messages (two probe renders)."""
    conv_a, conv_b = probe_conversations(static)
    a = render(conv_a)
    b = render(conv_b)
    return a[: common_prefix_len(a, b)]


def system_end(prompt_ids: Sequence[int], static_ids: Sequence[int]) -> int:
    """specprefill_system_end: where the prompt leaves the static scaffold."""
    return common_prefix_len(prompt_ids, static_ids)


# A multi-turn tail after the first user turn: an answer and a second question.
MULTI_TURN_TAIL: tuple[Message, ...] = (
    {"role": "assistant", "content": "OK."},
    {"role": "user", "content": "Go on."},
)


def multi_turn_probes(static: Sequence[Message]) -> tuple[list[Message], list[Message]]:
    """Two multi-turn conversations that differ only in their first user text."""
    conv_a, conv_b = probe_conversations(static)
    return [*conv_a, *MULTI_TURN_TAIL], [*conv_b, *MULTI_TURN_TAIL]


def text_start_cap(render: RenderIds, static: Sequence[Message]) -> int:
    """Where a multi-turn layout puts its first user text (two renders)."""
    conv_a, conv_b = multi_turn_probes(static)
    return common_prefix_len(render(conv_a), render(conv_b))


def is_probe_shape(messages: Sequence[Message], n_static: int) -> bool:
    """The static messages then one user message: the layout the scaffold was rendered in."""
    return len(messages) == n_static + 1 and messages[-1].get("role") == "user"


def first_text_replaced(messages: Sequence[Message], n_static: int) -> list[Message]:
    """The conversation with the first non-static message's content replaced by a probe text
    whose first character differs from that content's: its render leaves the real one exactly
    where that content starts."""
    message = messages[n_static]
    lead = _leading_text(message.get("content"))
    probe = PROBE_B if lead.startswith(PROBE_A[0]) else PROBE_A
    return [*messages[:n_static], {**message, "content": probe}, *messages[n_static + 1:]]


def _leading_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], Mapping):
        text = content[0].get("text")
        return text if isinstance(text, str) else ""
    return ""

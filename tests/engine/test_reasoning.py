"""A ``<think>`` family's reasoning cut out of the generated text, fed in every split."""

from __future__ import annotations

import pytest

from engine_adapter.reasoning import Reasoning, ReasoningSplitter, ThinkMarkers

MARKERS = ThinkMarkers("<think>", "</think>", ())


def split(text: str, inside: bool, step: int) -> tuple[str, str]:
    """(reasoning, answer) of ``text`` fed ``step`` characters at a time."""
    splitter = ReasoningSplitter(MARKERS, inside)
    pieces = [p for i in range(0, len(text), step) for p in splitter.feed(text[i:i + step])]
    pieces += splitter.feed("", final=True)
    return ("".join(p.text for p in pieces if isinstance(p, Reasoning)),
            "".join(p for p in pieces if isinstance(p, str)))


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize(("text", "inside", "expected"), [
    ("Hmm, 2+2.\n</think>\n\nIt is 4.", True, ("Hmm, 2+2.", "It is 4.")),    # Qwen3.5, R1
    ("<think>\nHmm.\n</think>\n\nIt is 4.", False, ("Hmm.", "It is 4.")),     # Qwen3 writes it
    ("\n<think>\n\n</think>\n\nIt is 4.", False, ("", "It is 4.")),            # an empty block
    ("It is 4. <think>x</think>", False, ("", "It is 4. <think>x</think>")),   # not at the start
    ("Still think", True, ("Still think", "")),                                # cut off inside
    ("It is < 5.", False, ("", "It is < 5.")),
])
def test_reasoning_and_answer_in_every_split(text, inside, expected, step):
    assert split(text, inside, step) == expected

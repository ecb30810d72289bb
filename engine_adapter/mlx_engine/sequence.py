"""One request inside the engine: what it asked for, where its events go, how it is doing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .request import GenerationRequest, PrefillInfo
from .reuse import ReusePlan

Deliver = Callable[[Any], None]  # gets TokenEvents, then possibly one exception


@dataclass(slots=True)
class EngineSequence:
    """A request's state on the engine thread."""

    request: GenerationRequest
    deliver: Deliver
    submitted: float                # perf_counter at submission: time to first token from it
    sampler: Any
    uid: int | None = None          # its row in the BatchGenerator, once inserted
    emitted: int = 0
    generated: list[int] = field(default_factory=list)  # the token ids emitted so far
    info: PrefillInfo | None = None
    plan: ReusePlan = field(default_factory=ReusePlan)

"""An OpenAI chat completion body as the pipeline's call: its conversation (``render_fields``)
and, when it is generated in this process, its parameters, checked.

Every bad parameter is an ``InvalidRequestError`` naming it (a 400), raised before anything is
resolved or run. Not supported: ``n`` > 1 and ``logprobs``. Tool calls come back as
``tool_calls`` where the engine cuts them out of its text (see ``engine_adapter.tool_calls``);
``response_format``, ``tool_choice`` and ``parallel_tool_calls`` go to the engine, which honours
them under a grammar or refuses them (``output_fields``).
Extension fields: ``specprefill``, ``specprefill_keep_pct``, ``specprefill_threshold``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engine.protocol import SamplingParams
from ..errors import InvalidRequestError
from .agent_call import AgentCall
from .fields import (
    INVALID,
    SEED_MAX,
    UNSUPPORTED,
    bool_field,
    check_relayed_numbers,
    float_field,
    int_field,
    specprefill_params,
    stop_strings,
)
from .output_fields import output_options
from .render_fields import chat_conversation

MAX_STOP_STRINGS = 4


@dataclass(frozen=True, slots=True)
class ChatCall:
    """An OpenAI chat body as the pipeline's call, and whether its stream ends with usage."""

    call: AgentCall
    include_usage: bool = False


def parse_chat_body(body: Mapping[str, Any], *, run_here: bool) -> ChatCall:
    """An OpenAI chat body as a call; ``run_here``: generated in this process (its parameters
    are checked, InvalidRequestError naming the first bad one), else the body goes upstream
    as it came and its parameters are the upstream's to check."""
    conversation = chat_conversation(body)
    model = body.get("model")
    model = model if isinstance(model, str) and model else None
    if not run_here:
        check_relayed_numbers(body)
        specprefill_params(body)  # the knobs go on to a specprefill upstream: checked here
        return ChatCall(AgentCall(model, conversation, SamplingParams(),
                                  stream=bool(body.get("stream") is True)))
    sampling, include_usage = _sampling(body)
    return ChatCall(AgentCall(model, conversation, sampling, specprefill_params(body),
                              stream=bool(bool_field(body, "stream")),
                              chat_options=output_options(body)), include_usage)


def _sampling(body: Mapping[str, Any]) -> tuple[SamplingParams, bool]:
    """The sampling parameters of a body generated here, and ``stream_options.include_usage``."""
    check_relayed_numbers(body)  # OpenAI's ranges first: an engine never sees a number past them
    n = int_field(body, "n", 1)
    if n not in (None, 1):
        raise InvalidRequestError("n > 1 is not supported by this engine", code=UNSUPPORTED)
    if body.get("logprobs"):
        raise InvalidRequestError("logprobs are not supported by this engine", code=UNSUPPORTED)
    max_tokens = int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", 1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequestError("stream_options must be an object", code=INVALID)
    temperature = float_field(body, "temperature", 0.0, 2.0)
    top_p = float_field(body, "top_p", 0.0, 1.0, low_open=True)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=int_field(body, "seed", 0, SEED_MAX),
        stop=stop_strings(body.get("stop"), "stop", MAX_STOP_STRINGS),
    )
    return sampling, bool(bool_field(options or {}, "include_usage"))

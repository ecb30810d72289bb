"""An OpenAI chat completion body's parameters, checked, as the neutral request a backend runs.

Every bad parameter is an ``InvalidRequestError`` naming it (a 400), raised before anything is
resolved or run. Not supported: ``n`` > 1 and ``logprobs``. Tool calls come back as
``tool_calls`` where the engine cuts them out of its text (see ``engine_adapter.tool_calls``).
Extension fields: ``specprefill``, ``specprefill_keep_pct``, ``specprefill_threshold``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from .backend import BackendRequest, SamplingParams, SpecPrefillParams
from .fields import (
    INVALID,
    UNSUPPORTED,
    bool_field,
    float_field,
    int_field,
    specprefill_params,
    stop_strings,
)

MAX_STOP_STRINGS = 4


@dataclass(frozen=True, slots=True)
class ChatParams:
    """What an OpenAI chat body asks for: the neutral parameters and the answer's shape."""

    model: str
    sampling: SamplingParams
    specprefill: SpecPrefillParams = SpecPrefillParams()
    stream: bool = False
    include_usage: bool = False

    def request(self, prompt_ids: Sequence[int], specprefill_system_end: int,
                namespace: str, tools: Any = None) -> BackendRequest:
        """The backend request for these parameters over a prompt and its boundary (and the
        tools the prompt offers, whose calls an engine may cut out of its text)."""
        return BackendRequest(prompt_ids=prompt_ids,
                              specprefill_system_end=specprefill_system_end,
                              namespace=namespace, sampling=self.sampling,
                              specprefill=self.specprefill,
                              tools=tools if isinstance(tools, list) else None)


def parse_chat_params(body: Mapping[str, Any], default_model: str) -> ChatParams:
    """The parameters of an OpenAI chat body; InvalidRequestError naming the first bad one."""
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
    model = body.get("model")
    temperature = float_field(body, "temperature", 0.0, 2.0)
    top_p = float_field(body, "top_p", 0.0, 1.0, low_open=True)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=int_field(body, "seed", 0),
        stop=stop_strings(body.get("stop"), "stop", MAX_STOP_STRINGS),
    )
    specprefill = specprefill_params(body)
    return ChatParams(model=model if isinstance(model, str) and model else default_model,
                      sampling=sampling, specprefill=specprefill,
                      stream=bool(bool_field(body, "stream")),
                      include_usage=bool(bool_field(options or {}, "include_usage")))


"""An OpenAI chat completion body's parameters, checked, as the neutral request a backend runs.

Every bad parameter is an ``InvalidRequestError`` naming it (a 400), raised before anything is
resolved or run. Not supported: ``n`` > 1 and ``logprobs``; tool calls come back as text.
Extension fields: ``specprefill``, ``specprefill_keep_pct``, ``specprefill_threshold``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from .backend import BackendRequest, SamplingParams, SpecPrefillParams

MAX_STOP_STRINGS = 4
INVALID, UNSUPPORTED = "invalid_value", "unsupported_parameter"


@dataclass(frozen=True, slots=True)
class ChatParams:
    """What an OpenAI chat body asks for: the neutral parameters and the answer's shape."""

    model: str
    sampling: SamplingParams
    specprefill: SpecPrefillParams = SpecPrefillParams()
    stream: bool = False
    include_usage: bool = False

    def request(self, prompt_ids: Sequence[int], specprefill_system_end: int,
                namespace: str) -> BackendRequest:
        """The backend request for these parameters over a prompt and its boundary."""
        return BackendRequest(prompt_ids=prompt_ids,
                              specprefill_system_end=specprefill_system_end,
                              namespace=namespace, sampling=self.sampling,
                              specprefill=self.specprefill)


def parse_chat_params(body: Mapping[str, Any], default_model: str) -> ChatParams:
    """The parameters of an OpenAI chat body; InvalidRequestError naming the first bad one."""
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise InvalidRequestError("n > 1 is not supported by this engine", code=UNSUPPORTED)
    if body.get("logprobs"):
        raise InvalidRequestError("logprobs are not supported by this engine", code=UNSUPPORTED)
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequestError("stream_options must be an object", code=INVALID)
    model = body.get("model")
    temperature = _float(body, "temperature", 0.0, 2.0)
    top_p = _float(body, "top_p", 0.0, 1.0, low_open=True)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=_int(body, "seed", 0),
        stop=_stops(body.get("stop")),
    )
    specprefill = SpecPrefillParams(
        enabled=_bool(body, "specprefill"),
        keep_pct=_float(body, "specprefill_keep_pct", 0.0, 1.0, low_open=True),
        threshold=_int(body, "specprefill_threshold", 0),
    )
    return ChatParams(model=model if isinstance(model, str) and model else default_model,
                      sampling=sampling, specprefill=specprefill,
                      stream=bool(_bool(body, "stream")),
                      include_usage=bool(_bool(options or {}, "include_usage")))


def _int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequestError(f"{name} must be an integer >= {minimum}, got {value!r}",
                                  code=INVALID)
    return value


def _float(body: Mapping[str, Any], name: str, low: float, high: float,
           low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (low < value if low_open else low <= value) or value > high:
        bound = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be a number in {bound}{low}, {high}], "
                                  f"got {value!r}", code=INVALID)
    return float(value)


def _bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {value!r}", code=INVALID)
    return value


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS \
            or not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError(f"stop must be a string or a list of at most "
                                  f"{MAX_STOP_STRINGS} strings", code=INVALID)
    return tuple(s for s in stops if s)

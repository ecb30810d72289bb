"""An agent API request in neutral terms: its conversation and how to generate, whichever API
it came in (Anthropic Messages, OpenAI Responses), and the same request as a chat completion
for an upstream that speaks only that."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine import protocol as wire
from ..engine.protocol import BackendRequest, OutputConstraints, SamplingParams, SpecPrefillParams
from ..errors import InvalidRequestError
from ..util.token_ids import TokenIds
from .conversation import Conversation, chat_wire_messages
from .fields import UNSUPPORTED


@dataclass(frozen=True, slots=True)
class AgentCall:
    """One request of an agent API, parsed and checked."""

    model: str | None
    conversation: Conversation
    sampling: SamplingParams
    specprefill: SpecPrefillParams = SpecPrefillParams()
    stream: bool = False
    # Fields of the chat completion an upstream that speaks only chat completions is sent
    # (temperature and top_p when the client set them, tool_choice, parallel_tool_calls,
    # top_k, response_format ...), in that API's terms. Only what the client sent: an upstream
    # applies its model's defaults (vLLM: the generation config) to what is absent.
    chat_options: Mapping[str, Any] = field(default_factory=dict)
    # Why the in-process engine cannot run this request as asked (a parameter it does not
    # honour), or None.
    engine_refusal: str | None = None
    # Fields only an upstream that serves the API itself honours (they have no chat-completion
    # equivalent and no engine support): refused wherever the request is converted.
    native_only: tuple[str, ...] = ()
    # Hosted tools the client sent (web_search ...), left out of the conversation: an upstream
    # that serves the API runs them; elsewhere they are dropped and said so (hosted_tools).
    hosted_tools: tuple[str, ...] = ()

    def check_engine_support(self) -> None:
        """InvalidRequestError (a 400) if an in-process engine cannot honour this request."""
        self.check_chat_support()
        if self.engine_refusal is not None:
            raise InvalidRequestError(self.engine_refusal, code=UNSUPPORTED)

    def check_chat_support(self) -> None:
        """InvalidRequestError (a 400) if this request cannot go as a chat completion."""
        if self.native_only:
            raise InvalidRequestError(f"{', '.join(self.native_only)}: supported only by an "
                                      "upstream that serves this API itself", code=UNSUPPORTED)

    def constraints(self) -> OutputConstraints:
        """What the output must be (a format, a tool call), from the chat-completion options."""
        return OutputConstraints.from_options(self.chat_options)

    def backend_request(self, prompt_ids: Sequence[int] | TokenIds, specprefill_system_end: int,
                        namespace: str) -> BackendRequest:
        """The engine's request for this call over a prompt and its boundary (that the engine
        can honour the call is checked once, before the prompt is prepared:
        ``check_engine_support``, run by the engine target's ``check``)."""
        return BackendRequest(prompt_ids=prompt_ids,
                              specprefill_system_end=specprefill_system_end,
                              namespace=namespace, sampling=self.sampling,
                              specprefill=self.specprefill, tools=self.conversation.tools,
                              constraints=self.constraints())

    def chat_body(self, model: str) -> dict[str, Any]:
        """This request as an OpenAI chat completion body (usage asked for when streamed)."""
        conversation, sampling = self.conversation, self.sampling
        body: dict[str, Any] = {"model": model,
                                "messages": chat_wire_messages(conversation.messages)}
        if conversation.tools is not None:
            body["tools"] = conversation.tools
        if conversation.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = conversation.chat_template_kwargs
        if sampling.max_tokens is not None:
            body["max_tokens"] = sampling.max_tokens
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        body.update(self.chat_options)
        knobs = ((wire.SPECPREFILL, self.specprefill.enabled),
                 (wire.SPECPREFILL_KEEP_PCT, self.specprefill.keep_pct),
                 (wire.SPECPREFILL_THRESHOLD, self.specprefill.threshold))
        body.update({name: value for name, value in knobs if value is not None})
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


def sent_fields(body: Mapping[str, Any], names: Sequence[str]) -> tuple[str, ...]:
    """Which of ``names`` a body sets to something other than null, false or empty."""
    return tuple(name for name in names if body.get(name) not in (None, False, 0, [], {}))


def sent_options(**fields: Any) -> dict[str, Any]:
    """The chat-completion fields a client set (None: not sent, so not forwarded)."""
    return {name: value for name, value in fields.items() if value is not None}

"""An in-process engine as a model's target: the turn's prompt ids and boundary run on it, in
the turn's namespace, and its outputs are answered in the turn's API."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import Response

from ..chat.agent_call import AgentCall
from ..chat.events import backend_events
from ..chat.fields import UNSUPPORTED
from ..engine_protocol import ChatBackend
from ..errors import InvalidRequestError
from .host import Api, Turn


@dataclass(frozen=True, slots=True)
class EngineTarget:
    backend: ChatBackend

    def relays(self, api: Api) -> bool:
        return False  # every API is answered here, from the engine's outputs

    def check(self, call: AgentCall, api: Api) -> None:
        call.check_engine_support()
        if call.constraints().binding and not getattr(self.backend, "constrained_decoding", False):
            raise InvalidRequestError(f"{_bound_field(call, api)} is not supported by this "
                                      "engine (no constrained decoding)", code=UNSUPPORTED)

    async def generate(self, turn: Turn) -> Response:
        ids = turn.result.prompt_ids
        request = self.backend.check(turn.call.backend_request(
            ids, turn.result.specprefill_system_end, turn.namespace))
        return await turn.answer(backend_events(self.backend, request), len(ids), turn.headers)


# The field a client sent, by API, for each chat-completion option that binds the output.
_FIELD_NAMES = {"chat": {"response_format": "response_format", "tool_choice": "tool_choice"},
                "messages": {"response_format": "output_config.format",
                             "tool_choice": "tool_choice"},
                "responses": {"response_format": "text.format", "tool_choice": "tool_choice"}}


def _bound_field(call: AgentCall, api: Api) -> str:
    """The name, in the client's API, of the field that binds the output."""
    names = _FIELD_NAMES.get(str(api), _FIELD_NAMES["chat"])
    format_kind = (call.chat_options.get("response_format") or {}).get("type", "text")
    return names["response_format" if format_kind != "text" else "tool_choice"]

"""An in-process engine as a model's target: the turn's prompt ids and boundary run on it, in
the turn's namespace, and its outputs are answered in the turn's API.

A binding output field (a JSON format, a forced tool call) reaches only an engine with
constrained decoding; every refusal names the field as the client's API spells it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..chat.agent_call import AgentCall
from ..chat.events import Events, backend_events
from ..chat.fields import UNSUPPORTED
from ..engine.protocol import ChatBackend
from ..errors import InvalidRequestError
from .host import Api, Relay, Turn

# The engine's name of the prompt's ids -> the body field a client sends them in (every API).
_PROMPT_IDS = (r"\bprompt_ids\b", "prompt_token_ids")
# Chat-completion field names (what the engine says) -> the client's, per API.
_API_TERMS: dict[str, tuple[tuple[str, str], ...]] = {
    "messages": ((r"response_format\.json_schema\.schema", "output_config.format.schema"),
                 (r"response_format", "output_config.format"),
                 (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema")),
    "responses": ((r"response_format\.json_schema\.schema", "text.format.schema"),
                  (r"response_format", "text.format"),
                  (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].parameters")),
}


@dataclass(frozen=True, slots=True)
class EngineTarget:
    backend: ChatBackend

    def relays(self, api: Api) -> bool:
        return False  # every API is answered here, from the engine's outputs

    def check(self, call: AgentCall, api: Api) -> None:
        call.check_engine_support()
        if call.constraints().binding and not getattr(self.backend, "constrained_decoding", False):
            field = "response_format" if _formats(call) else "tool_choice"
            raise InvalidRequestError(in_api_terms(f"{field} is not supported by this engine "
                                                   "(no constrained decoding)", api),
                                      code=UNSUPPORTED)

    async def generate(self, turn: Turn, relay: Relay) -> Events:
        prompt = turn.prompt
        try:
            request = self.backend.check(turn.call.backend_request(
                prompt.ids, prompt.specprefill_system_end, turn.namespace))
        except InvalidRequestError as exc:
            exc.args = (in_api_terms(str(exc), turn.api), *exc.args[1:])
            raise
        return backend_events(self.backend, request)


def _formats(call: AgentCall) -> bool:
    return (call.chat_options.get("response_format") or {}).get("type", "text") != "text"


def in_api_terms(message: str, api: str) -> str:
    """An engine's message with the chat-completion field names it uses in ``api``'s terms."""
    for pattern, name in (_PROMPT_IDS, *_API_TERMS.get(api, ())):
        message = re.sub(pattern, name, message, count=1)
    return message

"""An in-process engine as a model's target: the turn's prompt ids and boundary run on it, in
the turn's namespace, and its outputs are answered in the turn's API."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import Response

from ..chat.agent_call import AgentCall
from ..chat.events import backend_events
from ..engine_protocol import ChatBackend
from .host import Api, Turn
from .pipeline import recorded


@dataclass(frozen=True, slots=True)
class EngineTarget:
    backend: ChatBackend

    def relays(self, api: Api) -> bool:
        return False  # every API is answered here, from the engine's outputs

    def check(self, call: AgentCall, api: Api) -> None:
        call.check_engine_support()

    async def generate(self, turn: Turn) -> Response:
        ids = turn.result.prompt_ids
        request = self.backend.check(turn.call.backend_request(
            ids, turn.result.specprefill_system_end, turn.namespace))
        events = recorded(backend_events(self.backend, request))
        return await turn.answer(events, len(ids), turn.headers)

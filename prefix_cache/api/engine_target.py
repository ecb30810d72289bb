"""An in-process engine as a model's target: the turn's prompt ids and boundary run on it, in
the turn's namespace, and its outputs are answered in the turn's API.

A binding output field (a JSON format, a forced tool call) reaches only an engine with
constrained decoding; every refusal names the field as the client's API spells it.

The engine's check of a turn under a grammar (``ChatBackend.check``: the grammar compiled,
seconds for a large schema) runs in a thread, never on the event loop, so ``/healthz`` and every
other request are answered meanwhile (a turn without one is checked on the loop: microseconds).
It is bounded: the engine refuses a grammar past its size limit, and a check not done in
``CHECK_TIMEOUT_S`` is a 400 naming the limit. Checks count against the tenant's own share
(``_Gates``): one at a time per namespace and engine, a tenant's next waiting (on the loop) for
its last to end, even past a timeout, so a tenant sending slow schemas holds one thread at most,
never every other tenant's.
"""

from __future__ import annotations

import asyncio
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from ..chat.agent_call import AgentCall
from ..chat.events import Events, backend_events
from ..chat.fields import UNSUPPORTED
from ..engine.protocol import ChatBackend, CheckedBackendRequest
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


CHECK_TIMEOUT_S = 20.0   # a grammar's compile, at most (``CHECK_TIMEOUT`` is the 400's code)
CHECK_TIMEOUT = "grammar_compile_timeout"
_GATE_POLL_S = 0.005     # how often a tenant's next check looks whether its last one ended


class _Gates:
    """One lock per (engine, namespace): threading locks, taken without blocking from any
    event loop (several servers may share an engine in one process) and released by the
    check's thread when it ends."""

    def __init__(self) -> None:
        self._locks: weakref.WeakKeyDictionary[Any, dict[str, threading.Lock]] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    def of(self, backend: Any, namespace: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(backend, {}).setdefault(namespace, threading.Lock())


_gates = _Gates()


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
        try:
            request = await self._checked(turn)
        except InvalidRequestError as exc:
            exc.args = (in_api_terms(str(exc), turn.api), *exc.args[1:])
            raise
        return backend_events(self.backend, request)

    async def _checked(self, turn: Turn) -> CheckedBackendRequest:
        """The engine's check of the turn; under a grammar in a thread, once the tenant's last
        such check ended, and InvalidRequestError past ``CHECK_TIMEOUT_S`` (its thread runs on,
        holding the tenant's gate)."""
        prompt = turn.prompt
        backend_request = turn.call.backend_request(prompt.ids, prompt.specprefill_system_end,
                                                    turn.namespace)
        if not (backend_request.tools or backend_request.constraints.binding):
            return self.backend.check(backend_request)   # no grammar to compile
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CHECK_TIMEOUT_S
        gate = _gates.of(self.backend, turn.namespace)
        while not gate.acquire(blocking=False):
            if loop.time() >= deadline:
                raise _timed_out()
            await asyncio.sleep(_GATE_POLL_S)

        def check() -> CheckedBackendRequest:
            try:
                return self.backend.check(backend_request)
            finally:
                gate.release()

        try:
            running = loop.run_in_executor(None, check)
        except BaseException:
            gate.release()
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(running),
                                          max(0.0, deadline - loop.time()))
        except TimeoutError:
            running.add_done_callback(_retrieve)   # its late outcome is nobody's
            raise _timed_out() from None


def _timed_out() -> InvalidRequestError:
    return InvalidRequestError(
        f"the output's grammar (response_format, tools) did not compile within the limit of "
        f"{CHECK_TIMEOUT_S:g} s: send a smaller schema", code=CHECK_TIMEOUT)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _formats(call: AgentCall) -> bool:
    return (call.chat_options.get("response_format") or {}).get("type", "text") != "text"


def in_api_terms(message: str, api: str) -> str:
    """An engine's message with the chat-completion field names it uses in ``api``'s terms."""
    for pattern, name in (_PROMPT_IDS, *_API_TERMS.get(api, ())):
        message = re.sub(pattern, name, message, count=1)
    return message

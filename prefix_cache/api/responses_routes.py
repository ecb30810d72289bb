"""``POST /v1/responses`` (OpenAI Responses) and the stored responses: ``GET``/``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``, for both servers. A response
is stored in the caller's namespace (the host's store); an id of another namespace is a 404, as
one never stored.

Answers follow OpenAI's: the response object as it was answered; ``{"id", "object":
"response", "deleted": true}``; a list page ``{"object": "list", "data", "first_id",
"last_id", "has_more"}`` of the input items (``order`` desc by default, ``limit`` 1-100,
``after`` an item id), each with its ``id`` and messages' content as parts. Refused with a
400: ``stream=true`` (the response is finished) and ``include`` (nothing more is kept).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from ..chat.fields import UNSUPPORTED
from ..chat.respond import json_response, stream_response
from ..chat.responses_encode import (
    RelayedResponseRecorder,
    ResponseMeta,
    ResponseObject,
    new_id,
    response_json,
    response_stream,
)
from ..chat.responses_params import ResponsesRequest, parse_responses_body
from ..chat.responses_store import ResponseStore, StoredResponse
from ..errors import InvalidRequestError
from ..http.errors import NotFound
from ..http.sse import sse_event
from . import openapi_docs as docs
from .deps import Caller, HostDep
from .host import Relay, Turn
from .pipeline import admit, hosted_left_out, model_name, prepare, run

MAX_PAGE = 100
# Where an input message's text parts come from, by role (as OpenAI lists them).
TEXT_PART = {"assistant": "output_text"}


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


router = APIRouter()


@router.post("/v1/responses", openapi_extra=docs.json_body(ResponsesRequest),
             responses=docs.responses(ResponseObject, *docs.PREPARE_ERRORS,
                                      *docs.UPSTREAM_ERRORS, headers=docs.CACHE_HEADERS,
                                      stream=True))
async def responses(request: Request, host: HostDep, tenant: Caller) -> Response:
    async with host.slot(tenant):
        admitted = await admit(request, host, tenant, "responses")
        body, namespace = admitted.body, admitted.namespace
        # Before anything runs: a purge answering from here on keeps this answer out (``keep``).
        purge_stamp = await host.responses.stamp(namespace)
        model = host.model(model_name(body))
        # An upstream that serves Responses keeps its own responses, and decides on an id
        # unknown here; where the answer is made here, an unknown id is a 400.
        relayed = model.target.relays("responses")
        previous = body.get("previous_response_id")
        found = await host.responses.get(namespace, previous) if isinstance(previous, str) \
            else None
        parsed = parse_responses_body(body, lambda _: None if found is None else found.items,
                                      forward_unknown=relayed)
        call = parsed.call
        dropped = hosted_left_out(host, model, call, "responses")
        prompt = await prepare(host, "responses", model, call, admitted)

    async def keep(response: dict[str, Any]) -> None:
        if parsed.store:
            await host.responses.put(namespace, parsed.record(response), purge_stamp)

    # Without the history, the prompt ids cut here are not the upstream's prompt: it renders
    # the conversation it keeps itself (the boundary, the static part's end, still holds).
    relay = Relay(admitted.raw, body, RelayedResponseRecorder(call.stream, keep), _error_event,
                  with_prompt_ids=parsed.previous_known)
    headers = {**host.headers(prompt), **dropped}
    events = await run(model, Turn("responses", call, prompt, namespace, request), relay,
                       headers)
    if isinstance(events, Response):
        return events  # the upstream's answer, relayed (and recorded: ``keep``)
    meta = ResponseMeta(new_id("resp"), call.model or model.name, parsed.echo(),
                        namespaces=parsed.namespaces)
    if call.stream:
        return stream_response(response_stream(meta, events, keep), headers)
    return await json_response(request, response_json(meta, events, keep), headers)


async def _owner(request: Request, host: HostDep, tenant: Caller) -> tuple[ResponseStore, str]:
    """GET and DELETE have no body: the namespace is read from the query, as the host reads
    a body's (the engine server: ``specprefill_namespace`` under --trust-namespace)."""
    return host.responses, host.namespace(tenant, request.query_params)


Owner = Annotated[tuple[ResponseStore, str], Depends(_owner)]
STORED = (400, 401, 403, 404, 503)


@router.post("/v1/responses/input_tokens", include_in_schema=False)
async def input_tokens_not_served() -> Response:
    """Not served (docs/agent-apis.md): a 404 in OpenAI's shape, not the 405 the stored
    responses' path would give a POST."""
    raise NotFound("POST /v1/responses/input_tokens is not served here; the prompt's length is "
                   "in each response's usage", code="not_found")


@router.get("/v1/responses/{response_id}", responses=docs.responses(ResponseObject, *STORED))
async def retrieve_response(response_id: str, owner: Owner, stream: bool = False,
                            include: Annotated[list[str] | None, Query()] = None,
                            ) -> JSONResponse:
    if stream:
        raise InvalidRequestError("stream=true is not supported: a stored response is "
                                  "finished; GET it without stream", code=UNSUPPORTED)
    _refuse_include(include)
    return JSONResponse((await _find(owner, response_id)).response)


@router.delete("/v1/responses/{response_id}", responses=docs.responses(DeletedResponse, *STORED))
async def delete_response(response_id: str, owner: Owner) -> JSONResponse:
    store, namespace = owner
    if not await store.delete(namespace, response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items",
            responses=docs.responses(InputItemList, *STORED))
async def list_input_items(response_id: str, owner: Owner,
                           limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
                           order: Literal["asc", "desc"] = "desc",
                           after: str | None = None,
                           include: Annotated[list[str] | None, Query()] = None,
                           ) -> JSONResponse:
    _refuse_include(include)
    record = await _find(owner, response_id)
    return JSONResponse(input_items_page(record, limit, order, after))


def _error_event(message: str) -> bytes:
    """A relayed Responses stream that breaks ends with its API's error event."""
    return sse_event({"type": "error", "code": "upstream_interrupted", "message": message,
                      "param": None}, "error")


def input_items_page(record: StoredResponse, limit: int, order: str,
                     after: str | None) -> dict[str, Any]:
    """One page of a response's input items, as OpenAI lists them."""
    items = [listed_item(item) for item in record.input_items]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequestError(f"after: no input item {after!r} in this response")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit}


def listed_item(item: Any) -> dict[str, Any]:
    """An input item as listed: a message with its ``type`` and its content as parts."""
    if not isinstance(item, dict):
        return {"value": item}
    kind = item.get("type", "message" if "role" in item else None)
    if kind != "message":
        return dict(item)
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": TEXT_PART.get(item.get("role"), "input_text"), "text": content}]
    return {**item, "type": "message", "content": content,
            "status": item.get("status", "completed")}


async def _find(owner: tuple[ResponseStore, str], response_id: str) -> StoredResponse:
    store, namespace = owner
    record = await store.get(namespace, response_id)
    if record is None:
        raise _not_found(response_id)
    return record


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id {response_id!r} not found.", code="response_not_found")


def _refuse_include(include: list[str] | None) -> None:
    if include:
        raise InvalidRequestError("include is not supported: nothing beyond the response and "
                                  "its input items is kept", code=UNSUPPORTED)

"""``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``: a
tenant's stored responses, read and deleted. One router definition that both servers mount
(the sidecar and ``serve-engine``), each with its own way to name the caller's store and
tenant (``ResponsesScope``); an id of another tenant is a 404, as one never stored.

Answers follow OpenAI's: the response object as it was answered; ``{"id", "object":
"response", "deleted": true}``; a list page ``{"object": "list", "data", "first_id",
"last_id", "has_more"}`` of the input items (``order`` desc by default, ``limit`` 1-100,
``after`` an item id), each with its ``id`` and messages' content as parts. Refused with a
400: ``stream=true`` (the response is finished) and ``include`` (nothing more is kept).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ..errors import InvalidRequestError
from ..http.errors import NotFound
from .fields import UNSUPPORTED
from .responses_store import ResponseStore, StoredResponse
from .responses_stream import ResponseObject

MAX_PAGE = 100
# Where an input message's text parts come from, by role (as OpenAI lists them).
TEXT_PART = {"assistant": "output_text"}


@dataclass(frozen=True, slots=True)
class ResponsesScope:
    """The store a request reads and the tenant it reads as."""

    store: ResponseStore
    namespace: str


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


Docs = Callable[[type[BaseModel]], dict[int | str, Any]]


def stored_responses_router(scope: Callable[..., Awaitable[ResponsesScope]],
                            docs: Docs | None = None) -> APIRouter:
    """The three routes over the store and tenant ``scope`` (a FastAPI dependency) gives;
    ``docs(ok_model)``: each route's documented responses."""
    router = APIRouter()
    owned = Depends(scope)  # a default, not an Annotated alias: annotations here are strings

    def documented(ok: type[BaseModel]) -> dict[str, Any]:
        return {} if docs is None else {"responses": docs(ok)}

    @router.get("/v1/responses/{response_id}", **documented(ResponseObject))
    async def retrieve_response(response_id: str, owner: ResponsesScope = owned,
                                stream: bool = False,
                                include: Annotated[list[str] | None, Query()] = None,
                                ) -> JSONResponse:
        if stream:
            raise InvalidRequestError("stream=true is not supported: a stored response is "
                                      "finished; GET it without stream", code=UNSUPPORTED)
        _refuse_include(include)
        return JSONResponse((await _find(owner, response_id)).response)

    @router.delete("/v1/responses/{response_id}", **documented(DeletedResponse))
    async def delete_response(response_id: str, owner: ResponsesScope = owned) -> JSONResponse:
        if not await owner.store.delete(owner.namespace, response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @router.get("/v1/responses/{response_id}/input_items", **documented(InputItemList))
    async def list_input_items(response_id: str, owner: ResponsesScope = owned,
                               limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
                               order: Literal["asc", "desc"] = "desc",
                               after: str | None = None,
                               include: Annotated[list[str] | None, Query()] = None,
                               ) -> JSONResponse:
        _refuse_include(include)
        record = await _find(owner, response_id)
        return JSONResponse(input_items_page(record, limit, order, after))

    return router


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


async def _find(owner: ResponsesScope, response_id: str) -> StoredResponse:
    record = await owner.store.get(owner.namespace, response_id)
    if record is None:
        raise _not_found(response_id)
    return record


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id {response_id!r} not found.", code="response_not_found")


def _refuse_include(include: list[str] | None) -> None:
    if include:
        raise InvalidRequestError("include is not supported: nothing beyond the response and "
                                  "its input items is kept", code=UNSUPPORTED)

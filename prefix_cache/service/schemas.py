"""Request and response bodies of the sidecar's endpoints.

Request models check the types of the fields the sidecar reads and let every other field
through (``extra="allow"``): OpenAI bodies grow new fields all the time, and the upstream, not
the sidecar, is the judge of those. Roles and content parts are checked by
``prefix_cache.messages`` (the same rules as the library's), so their messages say which one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr


class ChatRequest(BaseModel):
    """An OpenAI chat completion body: the fields the boundary depends on, typed."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: StrictBool | None = None


class BoundaryRequest(ChatRequest):
    """``POST /v1/prefix/boundary``: a chat body, optionally asking for the prompt ids too."""

    return_prompt_ids: StrictBool = False


class PurgeRequest(BaseModel):
    """``POST /admin/purge``: a tenant, a model, or both (at least one)."""

    model_config = ConfigDict(extra="forbid")

    tenant: StrictStr | None = None
    model: StrictStr | None = None

"""Anthropic's Messages API request (``POST /v1/messages``, ``/v1/messages/count_tokens``):
the fields tokenbus takes, ignores, refuses or carries (:data:`OWNED`, :data:`IGNORED`,
:data:`CHAT_ONLY`, :data:`REFUSED`), the request model (:class:`MessagesRequest`) and its
validation (:func:`parse`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from bus_schemas import errors as E

Strict = Annotated[float, Field(strict=True)]

# Messages fields that are taken and have no effect here, and why (docs/anthropic.md).
IGNORED = {
    "cache_control": "prompt caching is the engine's own (vLLM caches prefixes by itself)",
    "speed": "tokenbus has one speed",
    "inference_geo": "tokenbus runs where it is deployed",
    "diagnostics": "not served",
    "context_management": "server-side context editing is not served; the conversation is "
    "sent whole",
    "user_profile_id": "not served",
    "workspace_id": "tokenbus has no workspaces (API keys scope models and limits)",
}

# Messages fields this package turns into chat fields (or acts on itself); the others of a
# request are carried to the engine unchanged, as the chat path carries them.
OWNED = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "stream",
        "service_tier",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "output_config",
        *IGNORED,
    }
)
# Chat fields that have another name (or no place) in the Messages API: refused, naming the
# field to use, rather than half-applied.
CHAT_ONLY = {
    "max_completion_tokens": "use `max_tokens`",
    "stop": "use `stop_sequences`",
    "response_format": "not a Messages API field",
    "n": "the Messages API returns one answer per request",
    "stream_options": "not a Messages API field (usage comes in message_delta)",
    "resume": "not a Messages API field",
}
# Fields of the Messages API that tokenbus does not serve: a clear 400 instead.
REFUSED = {
    "mcp_servers": "MCP servers run by the API are not served by tokenbus; run the MCP client "
    "yourself and give its tools as `tools`",
    "container": "code-execution containers are not served by tokenbus",
}


class MessagesRequest(BaseModel):
    """A Messages API request (``POST /v1/messages``): the fields tokenbus checks; messages,
    blocks and tools are checked while they are translated (:func:`translate`), so an error
    names the exact block (``messages.2.content.0.source``). Other fields are carried."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256, description="Model to serve it.")
    messages: list[Any] = Field(description="The conversation, user and assistant turns.")
    max_tokens: Annotated[StrictInt, Field(ge=1)] = Field(description="Most tokens to make.")
    system: StrictStr | list[Any] | None = Field(default=None, description="System prompt.")
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool | None = Field(default=None, description="Stream events (SSE).")
    temperature: Annotated[Strict, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[Strict, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    tools: list[Any] | None = Field(default=None, description="Client tools.")
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = Field(default=None, description="{user_id}.")
    thinking: dict[str, Any] | None = Field(default=None, description="{type, budget_tokens}.")
    output_config: dict[str, Any] | None = Field(default=None, description="{effort, format}.")


_bad = E.bad_field


def parse(body: Any, *, count: bool = False) -> MessagesRequest:
    """Validate a Messages request body; a bad field is a 400 naming it. ``count``: a
    ``count_tokens`` body, which has no ``max_tokens``."""
    if not isinstance(body, dict):
        raise E.InvalidRequest("the request body must be a JSON object")
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise _bad(name, why)
    for name, why in CHAT_ONLY.items():
        if name in body:
            raise _bad(name, f"not a Messages API field: {why}")
    mt = body.get("max_tokens")
    if isinstance(mt, float) and mt.is_integer():
        body = {**body, "max_tokens": int(mt)}
    if count:
        body = {**body, "max_tokens": 1}
    try:
        return MessagesRequest.model_validate(body)
    except ValidationError as exc:
        raise E.from_validation(exc, union_members=False) from None

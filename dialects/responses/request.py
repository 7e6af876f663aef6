"""The Responses API's request (``POST /v1/responses``): the fields tokenbus takes, refuses
or carries (:data:`OWNED`, :data:`CHAT_ONLY`, :data:`REFUSED`), the request model
(:class:`ResponsesRequest`), its validation (:func:`parse`) and response ids
(:data:`RESPONSE_ID`, :func:`new_response_id`).
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from bus_schemas import errors as E
from bus_schemas.messages import whole_numbers

Strict01 = Annotated[float, Field(strict=True)]

# Responses fields this package turns into chat fields (or acts on itself); the others of a
# request are carried to the engine unchanged, as the chat path carries them.
OWNED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "prompt",
        "store",
        "stream",
        "stream_options",
        "background",
        "max_output_tokens",
        "max_tool_calls",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "truncation",
        "include",
        "top_logprobs",
        "client_metadata",
    }
)
# Chat fields that have another name (or no place) in the Responses API: a body that sends
# one is refused, naming the field to use, rather than having it half-applied.
CHAT_ONLY = {
    "messages": "send the conversation as `input` items",
    "max_tokens": "use `max_output_tokens`",
    "max_completion_tokens": "use `max_output_tokens`",
    "response_format": "use `text.format`",
    "logprobs": 'use `include: ["message.output_text.logprobs"]` and `top_logprobs`',
    "reasoning_effort": "use `reasoning.effort`",
    "n": "the Responses API returns one answer per request",
    "resume": "not a Responses field",
}
# Fields of the Responses API that tokenbus does not serve: a clear 400 instead.
REFUSED = {
    "conversation": "the Conversations API is not served by tokenbus; use "
    "`previous_response_id` or send the whole conversation as `input`",
    "context_management": "server-side compaction is not served by tokenbus",
}
BUILT_IN_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer",
        "computer_use",
        "computer_use_preview",
        "code_interpreter",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)
# Hosted web search, which Codex CLI puts in every request by default (its `web_search` setting
# defaults to "cached"): tokenbus cannot search, so the tool is left out of what the engine
# sees rather than the request refused (docs/responses.md). Forcing it by tool_choice is a 400.
WEB_SEARCH_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
    }
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
# What a response id looks like (also a valid JetStream KV key).
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


class ResponsesRequest(BaseModel):
    """A Responses API request (``POST /v1/responses``): the fields tokenbus checks; items,
    tools and formats are checked while they are translated (:func:`translate`), so an error
    names the exact item (``input.2.call_id``). Other fields are carried to the engine."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256, description="Model to serve it.")
    input: StrictStr | list[Any] | None = Field(
        default=None,
        description="Text, or a list of input items (none: a `previous_response_id` "
        "conversation continued as it stands, or the `instructions` alone).",
    )
    instructions: StrictStr | None = Field(
        default=None, description="A system message put first (not carried to later turns)."
    )
    previous_response_id: StrictStr | None = Field(
        default=None, description="Continue the conversation of this stored response."
    )
    store: StrictBool | None = Field(default=None, description="Keep the response (default).")
    stream: StrictBool | None = Field(default=None, description="Stream events (SSE).")
    background: StrictBool | None = Field(
        default=None,
        description="Answer at once with a queued response and run it detached (docs/batches.md).",
    )
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Strict01, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Strict01, Field(ge=0.0, le=1.0)] | None = None
    tools: list[Any] | None = Field(default=None, description="Function tools.")
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = Field(default=None, description="{format, verbosity}.")
    reasoning: dict[str, Any] | None = Field(default=None, description="{effort, summary}.")
    truncation: Literal["auto", "disabled"] | None = None
    include: list[StrictStr] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    prompt_cache_key: StrictStr | None = Field(
        default=None,
        description="Carried to the engine, and the session key of session-affinity routing.",
    )
    client_metadata: Any = Field(
        default=None, description="About the client (Codex sends it): accepted, not carried."
    )

    @property
    def stored(self) -> bool:
        """Whether the response is to be kept (``store`` defaults to true)."""
        return self.store is not False


_bad = E.bad_field


def parse(body: Any) -> ResponsesRequest:
    """Validate a Responses request body; a bad field is a 400 naming it."""
    if not isinstance(body, dict):
        raise E.InvalidRequest("the request body must be a JSON object")
    whole_numbers(body)
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise _bad(name, why)
    if body.get("background") is True and body.get("store") is False:
        raise _bad("background", "a background response is kept: send it without store: false")
    if body.get("prompt") is not None:
        raise _bad("prompt", "prompt templates are not served by tokenbus; send `input`")
    for name, why in CHAT_ONLY.items():
        if name in body:
            raise _bad(name, f"not a Responses API field: {why}")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        # pydantic names the member of a union that failed (input.str): the field is enough.
        raise E.from_validation(exc, union_members=False) from None
    if req.truncation == "auto":
        raise _bad(
            "truncation",
            "'auto' (dropping the oldest input to fit the context) is not served by tokenbus; "
            "send 'disabled' or leave it out (a prompt too long for the model is a 400)",
        )
    return req


def new_response_id() -> str:
    """A fresh response id: random, so no client can choose one that names another's."""
    return f"resp_{uuid.uuid4().hex}"

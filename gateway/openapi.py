"""The bridge's OpenAPI 3.1 document (``GET /openapi.json``), as ``vllm serve`` serves one.

The request schemas are the pydantic models :mod:`gateway.validation` really validates
(:class:`~bus_schemas.messages.ChatCompletionRequest`, ``CompletionRequest``,
``EmbeddingRequest``); the response schemas are the small models below, which describe
exactly what :mod:`gateway.openai_api` writes (its whole answers, its SSE events and
OpenAI's error body). A client generator or a fuzzer (``schemathesis`` in
``tests/test_fuzz_openapi.py``) reads the same contract the bridge enforces.

Built once per process and kept as bytes: :func:`document_bytes`.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib import metadata
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bus_schemas import errors as E
from bus_schemas.messages import (
    MAX_CHOICES,
    MAX_EMBEDDING_INPUTS,
    MAX_PROMPTS,
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from dialects.responses import RESPONSE_ID, ResponsesRequest

REF = "#/components/schemas/{model}"


class _Out(BaseModel):
    """A response object the bridge builds itself: exactly these fields, nothing else."""

    model_config = ConfigDict(extra="forbid")


# -- errors ---------------------------------------------------------------------------------
class ErrorDetail(_Out):
    """OpenAI's error object."""

    message: str = Field(description="What went wrong and what to do about it.")
    type: str = Field(description="OpenAI's error type, e.g. invalid_request_error.")
    param: str | None = Field(description="The request field at fault, when there is one.")
    code: str = Field(description="tokenbus's error code, e.g. invalid_request, no_replica.")


class ErrorResponse(_Out):
    """Every 4xx and 5xx body (and an SSE error event once a stream has started)."""

    error: ErrorDetail


# -- generation -----------------------------------------------------------------------------
class Usage(_Out):
    """OpenAI's ``usage``; the details objects only when the engine reports them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


class AssistantMessage(_Out):
    """The answer of a whole chat completion."""

    role: Literal["assistant"]
    content: str | None = Field(description="The text; null when only tool calls or a refusal.")
    refusal: str | None
    tool_calls: list[dict[str, Any]] | None = Field(
        default=None, description="As the engine returned them (present only when any)."
    )
    reasoning_content: str | None = Field(
        default=None, description="A reasoning model's reasoning (present only when any)."
    )


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = Field(description="As the engine returned them.")
    finish_reason: str


# The class that served the answer (docs/flow.md).
ServiceTier = Literal["priority", "default", "flex"]


class ChatCompletion(_Out):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    service_tier: ServiceTier | None = None


class TextChoice(_Out):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str


class TextCompletion(_Out):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class ChatDelta(_Out):
    """What one chunk adds to the message."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionChunk(_Out):
    """One SSE event of a streamed chat completion; the usage event (``stream_options.
    include_usage``) has no choices and a ``usage``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    service_tier: ServiceTier | None = None


class TextChunkChoice(_Out):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class TextCompletionChunk(_Out):
    """One SSE event of a streamed text completion (the usage event as for chat)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChunkChoice]
    usage: Usage | None = None


# -- embeddings -----------------------------------------------------------------------------
class Embedding(_Out):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(
        description="The vector; with encoding_format base64, little-endian float32 in base64."
    )


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Out):
    """``POST /v1/embeddings``."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# -- plain endpoints ------------------------------------------------------------------------
class Model(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(
        default=None, description="The model's context length, where its replicas report it."
    )


class ModelList(_Out):
    """``GET /v1/models``: the models served now that the key may use."""

    object: Literal["list"]
    data: list[Model]


class Health(_Out):
    """``GET /health``."""

    status: Literal["ok", "unhealthy"]


class Ready(_Out):
    """``GET /ready``: whether the bridge can serve, and the models it serves now."""

    status: Literal["ready", "not ready"]
    models: list[str]


# What each generation endpoint may answer besides 200, from the error tree: a typed error's
# status (bus_schemas.errors) with OpenAI's body. 499 (the client left) is never seen by one.
ERRORS: dict[int, str] = {
    400: "The body is not JSON, not an object, or a field is wrong (param names it).",
    401: "No API key, or not a valid one (where keys are checked).",
    403: "The key may not use this model.",
    404: "No such model (or no such route).",
    408: "The body did not all arrive in time; the connection is closed.",
    413: "The body, or the prompt, is larger than the bridge takes.",
    429: "A rate limit of the key; Retry-After says when to try again.",
    431: "The request line and headers are larger than the bridge takes.",
    500: "The gateway failed; retry.",
    502: "The engine failed; retry.",
    503: "No replica, every replica busy, or a stage unreachable; retry (Retry-After).",
    504: "The request ran past its deadline.",
}


# -- the Responses API ----------------------------------------------------------------------
class _Open(BaseModel):
    """A Responses API object: these fields at least (output items and usage carry what
    the engine reports, as OpenAI's do)."""

    model_config = ConfigDict(extra="allow")


class ResponseObject(_Open):
    """A response (``POST /v1/responses`` whole, ``GET /v1/responses/{id}``, and inside
    ``response.created`` / ``.in_progress`` / ``.completed`` / ``.failed`` events)."""

    id: str = Field(pattern=RESPONSE_ID.pattern)
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress", "queued", "cancelled"]
    model: str
    output: list[dict[str, Any]]
    error: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None


class ResponseStreamEvent(_Open):
    """One SSE event of a streamed response: ``response.created``, ``.output_text.delta``,
    ``.completed``, an ``error`` ... each numbered in order."""

    type: str
    sequence_number: int = Field(ge=0)


class ResponseDeleted(_Out):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ResponseItemList(_Out):
    """A page of a stored response's input items."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def _statuses(cls: type[E.TokenbusError] = E.TokenbusError) -> set[int]:
    """The HTTP status of every typed error (a test keeps :data:`ERRORS` describing each)."""
    out = {cls.status}
    for sub in cls.__subclasses__():
        out |= _statuses(sub)
    return out


# 499: the client left (nobody reads the answer); 507: the Files API's store is full (no
# generation endpoint answers it).
STATUSES = sorted(_statuses() - {499, 507})


def _schemas(*models: type[BaseModel]) -> dict[str, Any]:
    """JSON Schemas of ``models`` by name, their nested models lifted to the top."""
    out: dict[str, Any] = {}
    for m in models:
        s = m.model_json_schema(ref_template=REF)
        out.update(s.pop("$defs", {}))
        out[m.__name__] = s
    return out


def _request_schemas() -> dict[str, Any]:
    """The request models' schemas, plus what their validators accept beyond them."""
    out = _schemas(ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ResponsesRequest)
    for name in (
        "ChatCompletionRequest",
        "CompletionRequest",
        "EmbeddingRequest",
        "ResponsesRequest",
    ):
        # Fields tokenbus does not act on are carried to the engine as sent.
        out[name]["additionalProperties"] = True
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = out[name]["properties"]
        # ``stop`` is normalised before validation: one string is one stop sequence (an
        # empty one stops at nothing).
        props["stop"]["anyOf"].insert(0, {"type": "string"})
        props["stop"]["anyOf"][1]["maxItems"] = MAX_STOP_SEQUENCES
        # 1 to MAX_CHOICES choices (the bridge sends one request per choice).
        props["n"]["anyOf"][0].update(minimum=1, maximum=MAX_CHOICES)
        # logit_bias maps token ids (digits) to a bias.
        props["logit_bias"]["anyOf"][0]["propertyNames"] = {"pattern": "^[0-9]+$"}
    # A prompt list holds one prompt or more (one choice each); a token id prompt, one id
    # or more (each from 0).
    _, texts_p, ids_p, id_lists_p = out["CompletionRequest"]["properties"]["prompt"]["anyOf"][:4]
    texts_p.update(minItems=1, maxItems=MAX_PROMPTS)
    ids_p["minItems"] = 1
    ids_p["items"]["minimum"] = 0
    id_lists_p.update(minItems=1, maxItems=MAX_PROMPTS)
    id_lists_p["items"].update(minItems=1)
    id_lists_p["items"]["items"]["minimum"] = 0
    # Embedding inputs: none empty, at most MAX_EMBEDDING_INPUTS texts.
    text, texts, ids, id_lists = out["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    text["minLength"] = 1
    texts.update(minItems=1, maxItems=MAX_EMBEDDING_INPUTS)
    texts["items"]["minLength"] = 1
    ids["minItems"] = 1
    id_lists.update(minItems=1, maxItems=MAX_EMBEDDING_INPUTS)
    id_lists["items"]["minItems"] = 1
    return out


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": REF.format(model=ref)}}}


def sse_event(data: dict[str, Any]) -> dict[str, Any]:
    """The schema of one server-sent event (OpenAPI 3.1 reads an event stream's ``schema``
    as one event's) whose data is ``[DONE]`` or JSON that ``data`` describes."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "if": {"const": "[DONE]"},
                "else": {"contentMediaType": "application/json", "contentSchema": data},
            }
        },
    }


def _sse(chunk: str) -> dict[str, Any]:
    """An event stream: each event's data is a chunk, an error (after which only the end
    follows), or ``[DONE]``."""
    error = {"$ref": REF.format(model="ErrorResponse")}
    data = {"anyOf": [{"$ref": REF.format(model=chunk)}, error]}
    return {"text/event-stream": {"schema": sse_event(data)}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {
        str(s): {
            # A status added to the error tree but not yet here still gets documented.
            "description": ERRORS.get(s, f"An error with HTTP status {s}."),
            "content": _json("ErrorResponse"),
        }
        for s in statuses
    }


_SECURITY: list[dict[str, list[str]]] = [{"bearerAuth": []}, {"apiKeyAuth": []}]


def _generation(op_id: str, summary: str, request: str, answer: str, chunk: str | None) -> Any:
    content = _json(answer)
    if chunk is not None:
        content.update(_sse(chunk))
    return {
        "post": {
            "operationId": op_id,
            "summary": summary,
            "tags": ["OpenAI"],
            "security": _SECURITY,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": "The answer: whole as JSON, or as server-sent events "
                    "with `stream: true`."
                    if chunk
                    else "The embeddings.",
                    "content": content,
                },
                **_errors(*STATUSES),
            },
        }
    }


def _get(op_id: str, summary: str, answer: str, responses: dict[str, Any], **kw: Any) -> Any:
    return {
        "get": {
            "operationId": op_id,
            "summary": summary,
            "responses": {"200": {"description": summary, "content": _json(answer)}, **responses},
            **kw,
        }
    }


def _response_events() -> dict[str, Any]:
    """A Responses event stream: every event named (``event:``) and numbered."""
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"$ref": REF.format(model="ResponseStreamEvent")},
    }
    return {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "required": ["event", "data"],
                "properties": {"event": {"type": "string"}, "data": data},
            }
        }
    }


_RESPONSE_ID = {
    "name": "response_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "A response's id (resp_ and 32 hex digits); another key's is not found.",
}


def _responses_paths() -> dict[str, Any]:
    create = _generation(
        "createResponse",
        "Create a response (the Responses API)",
        "ResponsesRequest",
        "ResponseObject",
        None,
    )
    create["post"]["responses"]["200"] = {
        "description": "The response: whole as JSON, or as server-sent events with `stream: true`.",
        "content": {**_json("ResponseObject"), **_response_events()},
    }
    stored = {"tags": ["OpenAI"], "security": _SECURITY, "parameters": [_RESPONSE_ID]}
    found = _errors(400, 401, 404, 405)
    page = [
        _RESPONSE_ID,
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
        {"name": "after", "in": "query", "schema": {"type": "string"}},
    ]
    by_id = _get("getResponse", "A stored response.", "ResponseObject", found, **stored)
    by_id["delete"] = _get(
        "deleteResponse", "Delete a stored response.", "ResponseDeleted", found, **stored
    )["get"]
    items = _get(
        "listInputItems",
        "A stored response's input items, a page at a time.",
        "ResponseItemList",
        found,
        **{**stored, "parameters": page},
    )
    return {
        "/v1/responses": create,
        "/v1/responses/{response_id}": by_id,
        "/v1/responses/{response_id}/input_items": items,
    }


def _version() -> str:
    try:
        return metadata.version("tokenbus")
    except metadata.PackageNotFoundError:
        return "0"


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the OpenAI-compatible API (a fresh copy)."""
    return copy.deepcopy(_document())


@cache
def _document() -> dict[str, Any]:
    schemas = _request_schemas()
    schemas.update(
        _schemas(
            ErrorResponse,
            ChatCompletion,
            ChatCompletionChunk,
            TextCompletion,
            TextCompletionChunk,
            EmbeddingList,
            ModelList,
            Health,
            Ready,
            ResponseObject,
            ResponseStreamEvent,
            ResponseDeleted,
            ResponseItemList,
        )
    )
    schemas["OpenAPIDocument"] = {"type": "object", "required": ["openapi", "paths"]}
    ready_503 = {"description": "Not ready to serve.", "content": _json("Ready")}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tokenbus",
            "version": _version(),
            "description": "OpenAI-compatible HTTP API of the tokenbus bridge. Request "
            "fields not listed are carried to the engine unchanged.",
        },
        "paths": {
            "/v1/chat/completions": _generation(
                "createChatCompletion",
                "Chat completion",
                "ChatCompletionRequest",
                "ChatCompletion",
                "ChatCompletionChunk",
            ),
            "/v1/completions": _generation(
                "createCompletion",
                "Text completion",
                "CompletionRequest",
                "TextCompletion",
                "TextCompletionChunk",
            ),
            "/v1/embeddings": _generation(
                "createEmbedding", "Embeddings", "EmbeddingRequest", "EmbeddingList", None
            ),
            **_responses_paths(),
            "/v1/models": _get(
                "listModels",
                "The models served now that the key may use.",
                "ModelList",
                _errors(401),
                tags=["OpenAI"],
                security=_SECURITY,
            ),
            "/health": _get(
                "health",
                "The bridge is connected and serving.",
                "Health",
                {"503": {"description": "Unhealthy.", "content": _json("Health")}},
                security=[],
            ),
            "/ready": _get(
                "ready",
                "The bridge can serve (some replica is live).",
                "Ready",
                {"503": ready_503},
                security=[],
            ),
            "/openapi.json": _get("openapi", "This document.", "OpenAPIDocument", {}, security=[]),
        },
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Authorization: Bearer <API key> (`tokenbus keys create`); "
                    "checked where the pipeline runs the auth stage.",
                },
                "apiKeyAuth": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "api-key",
                    "description": "The same key, Azure-style.",
                },
            },
        },
    }


@cache
def document_bytes() -> bytes:
    """The document as the JSON ``GET /openapi.json`` sends, encoded once."""
    return json.dumps(_document(), separators=(",", ":")).encode()

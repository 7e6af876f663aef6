"""Turning OpenAI-shaped request bodies into validated models, with OpenAI-shaped errors,
and validated requests into bus envelopes.

tokenbus validates strictly the fields it acts on (model, limits, sizes, messages, and the
shape of tools, response_format and logprobs, which the filter and the simulator read) and
carries every other field to the engine unchanged (:func:`bus_schemas.messages.carried`).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from pydantic import ValidationError

from bus_schemas import errors as E
from bus_schemas.messages import (
    SCHEMA_VERSION,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingParams,
    carried,
    whole_numbers,
)
from bus_schemas.subjects import KIND_CHAT, KIND_EMBEDDINGS

Request = ChatCompletionRequest | CompletionRequest | EmbeddingRequest

_MODELS: dict[str, type[Request]] = {
    KIND_CHAT: ChatCompletionRequest,
    KIND_EMBEDDINGS: EmbeddingRequest,
}
# Embeddings take no generation parameters; the envelope's are the defaults.
_NO_SAMPLING = SamplingParams(max_tokens=1).model_dump(exclude={"type"})


def parse(kind: str, body: Any) -> Request:
    """Validate ``body`` for ``kind`` (chat, completions or embeddings); raise
    :class:`E.InvalidRequest`."""
    if not isinstance(body, dict):
        raise E.InvalidRequest("the request body must be a JSON object")
    whole_numbers(body)
    model = _MODELS.get(kind, CompletionRequest)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise E.from_validation(exc) from None


def check_chat(body: Any) -> Request:
    """A chat completion request checked as :func:`parse` checks one (what a job queued
    now and run later is checked with: a bad request is refused when queued)."""
    return parse(KIND_CHAT, body)


def prompt_chars(req: Request) -> int:
    """Size of the request's text, for the oversized-prompt check (images, audio and files
    count toward the body limit only)."""
    extra = len(req.resume.text) if req.resume is not None else 0
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages) + extra
    if isinstance(req, EmbeddingRequest):
        return sum(len(i) if isinstance(i, str | list) else 1 for i in req.inputs)
    return sum(len(p) for p in req.prompts) + extra


def per_prompt(
    req: CompletionRequest, body: dict[str, Any]
) -> list[tuple[CompletionRequest, dict[str, Any]]]:
    """A completions request as the bus takes it: one request per prompt (in order), and
    ``max_tokens: 0`` asked as one token without ``echo`` (the caller drops what it makes
    and writes the prompt itself). ``[(req, body)]`` when it is one already."""
    if len(req.prompts) == 1 and req.generates:
        return [(req, body)]
    one: dict[str, Any] = {}
    if not req.generates:
        one = {"max_tokens": 1, "max_completion_tokens": None, "echo": False}
    out: list[tuple[CompletionRequest, dict[str, Any]]] = []
    for prompt in req.prompts:
        sub = {**body, "prompt": prompt, **one}
        out.append((req.model_copy(update={"prompt": prompt, **one}), sub))
    return out


def envelope(
    kind: str,
    req: Request,
    body: dict[str, Any],
    request_id: str,
    *,
    default_max_tokens: int,
    deadline_ms: int | None,
) -> dict[str, Any]:
    """The bus envelope (see :class:`bus_schemas.messages.Envelope`) for a validated request;
    ``body`` is the request as the client sent it (its messages and other fields travel as
    they are)."""
    env: dict[str, Any] = {
        "type": "envelope",
        "v": SCHEMA_VERSION,
        "request_id": request_id,
        "kind": kind,
        "model": req.model,
        "deadline_ms": deadline_ms,
        "extra": carried(body),
    }
    if isinstance(req, EmbeddingRequest):
        env["params"] = dict(_NO_SAMPLING)
        env["input"] = req.inputs
        return env
    env["params"] = req.sampling(default_max_tokens).model_dump(exclude={"type"})
    if isinstance(req, ChatCompletionRequest):
        env["messages"] = body["messages"]
    else:
        if len(req.prompts) != 1:
            raise E.InvalidRequest(
                "prompt: a request on the bus holds one prompt (the HTTP bridge sends one "
                "request per prompt of a list); send one request per prompt",
                param="prompt",
            )
        if not req.generates:
            raise E.InvalidRequest(
                "max_tokens: a request on the bus makes at least one token (the HTTP bridge "
                "answers max_tokens 0 itself)",
                param="max_tokens",
            )
        env["prompt"] = req.prompt_text
    if req.resume is not None:
        env["resume"] = req.resume.model_dump(exclude={"type"})
    return env


_SAFE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def clean_request_id(value: str | None) -> str:
    """The caller's request id when it is a short, plain token; a fresh one otherwise."""
    if value and _SAFE_ID.fullmatch(value):
        return value
    return uuid.uuid4().hex

"""Turning OpenAI-shaped request bodies into validated models, with OpenAI-shaped errors,
and validated requests into bus envelopes.

tokenbus validates strictly the fields it acts on (model, limits, sizes, messages, and the
shape of tools, response_format and logprobs, which the filter and the simulator read) and
carries every other field to the engine unchanged (:func:`bus_schemas.messages.carried`).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from bus_schemas import errors as E
from bus_schemas import marks
from bus_schemas.messages import (
    MAX_PROMPTS,
    SCHEMA_VERSION,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingParams,
    carried,
    token_ids_text,
    whole_numbers,
)
from bus_schemas.subjects import KIND_CHAT, KIND_EMBEDDINGS

Request = ChatCompletionRequest | CompletionRequest | EmbeddingRequest
# A request answered as one choice or several (n, or a list of prompts).
Choosing = ChatCompletionRequest | CompletionRequest

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
    return sum(len(p if isinstance(p, str) else token_ids_text(p)) for p in req.prompts) + extra


def per_choice(req: Choosing, body: dict[str, Any]) -> list[tuple[Choosing, dict[str, Any]]]:
    """A chat or completions request as the bus takes it: one request per prompt and
    choice, in OpenAI's order (prompt ``i``'s choice ``j`` is choice ``i * n + j``), each
    with ``n`` 1 and, when the request has a ``seed``, ``seed + j`` (choices that differ,
    reproducibly, as one seeded engine request's ``n`` sequences do); a completion's
    ``max_tokens: 0`` asked as one token without ``echo`` (the caller drops what it makes
    and writes the prompt itself). ``[(req, body)]`` when it is one already."""
    n = req.choices
    prompts: list[str | list[int] | None] = [None]
    generates = True
    if isinstance(req, CompletionRequest):
        prompts, generates = list(req.prompts), req.generates
        if not generates and req.echo and any(isinstance(p, list) for p in prompts):
            raise E.InvalidRequest(
                "echo: with max_tokens 0 the bridge writes the prompt itself, and it cannot "
                "turn token ids into text; send the prompt as text, or ask for a token",
                param="echo",
            )
    if n == 1 and len(prompts) == 1 and generates:
        return [(req, body)]
    if len(prompts) * n > MAX_PROMPTS:
        raise E.InvalidRequest(
            f"n: {n} choices of {len(prompts)} prompts is {len(prompts) * n} answers; at most "
            f"{MAX_PROMPTS} per request",
            param="n",
        )
    one: dict[str, Any] = {}
    if not generates:
        one = {"max_tokens": 1, "max_completion_tokens": None, "echo": False}
    out: list[tuple[Choosing, dict[str, Any]]] = []
    for prompt in prompts:
        for j in range(n):
            update: dict[str, Any] = {**one, "n": 1}
            if prompt is not None:
                update["prompt"] = prompt
            if req.seed is not None and j:
                update["seed"] = req.seed + j
            out.append((req.model_copy(update=update), {**body, **update}))
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
    if req.choices != 1:
        raise E.InvalidRequest(
            "n: a request on the bus holds one choice (the HTTP bridge sends one request per "
            "choice); send n requests",
            param="n",
        )
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
        env["prompt"] = req.prompt_value  # text, or token ids
    if req.resume is not None:
        env["resume"] = req.resume.model_dump(exclude={"type"})
    return env


_SAFE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def clean_request_id(value: str | None) -> str:
    """The caller's request id when it is a short, plain token; a fresh one otherwise."""
    return client_label(value) or marks.new_request_id()


def client_label(value: str | None) -> str | None:
    """The caller's own request id when it is a short, plain token (a label for its logs and
    the response header), else None."""
    return value if value and _SAFE_ID.fullmatch(value) else None

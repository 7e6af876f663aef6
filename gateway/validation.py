"""Turning OpenAI-shaped request bodies into validated models, with OpenAI-shaped errors."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from bus_schemas import errors as E
from bus_schemas.messages import ChatCompletionRequest, CompletionRequest
from bus_schemas.subjects import KIND_CHAT

Request = ChatCompletionRequest | CompletionRequest


def parse(kind: str, body: Any) -> Request:
    """Validate ``body`` for ``kind`` (chat or completions); raise :class:`E.InvalidRequest`."""
    if not isinstance(body, dict):
        raise E.InvalidRequest("the request body must be a JSON object")
    model = ChatCompletionRequest if kind == KIND_CHAT else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = first.get("msg", "invalid value")
        more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
        raise E.InvalidRequest(f"{loc or 'body'}: {msg}{more}", param=loc or None) from None


def prompt_chars(req: Request) -> int:
    """Size of the request's text, for the oversized-prompt check."""
    extra = len(req.resume.text) if req.resume is not None else 0
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages) + extra
    return len(req.prompt_text) + extra


def envelope(
    kind: str, req: Request, request_id: str, *, default_max_tokens: int, deadline_ms: int | None
) -> dict[str, Any]:
    """The bus envelope (see :class:`bus_schemas.messages.Envelope`) for a validated request."""
    env: dict[str, Any] = {
        "type": "envelope",
        "v": 1,
        "request_id": request_id,
        "kind": kind,
        "model": req.model,
        "params": req.sampling(default_max_tokens).model_dump(exclude={"type"}),
        "deadline_ms": deadline_ms,
    }
    if isinstance(req, ChatCompletionRequest):
        env["messages"] = [{"role": m.role, "content": m.text()} for m in req.messages]
    else:
        env["prompt"] = req.prompt_text
    if req.resume is not None:
        env["resume"] = req.resume.model_dump(exclude={"type"})
    return env

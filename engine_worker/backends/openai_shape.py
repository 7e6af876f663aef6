"""OpenAI request bodies and streamed chunks, as the backends that speak them need them (the
``openai`` backend over HTTP, the ``vllm`` backend to vLLM's serving layer in-process)."""

from __future__ import annotations

from typing import Any

from bus_schemas.side_outputs import GENERATION
from engine_worker.backends.base import Delta, GenerationRequest

# The finish reasons passed on as they are; any other becomes "stop".
FINISH_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls"})
USAGE_DETAILS = ("prompt_tokens_details", "completion_tokens_details")


def set_sampling(body: dict[str, Any], req: GenerationRequest) -> None:
    """The sampling values tokenbus owns, only those the client set: an unset temperature or
    top_p leaves the model's own generation defaults in force."""
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.seed is not None:
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)


def chat_messages(req: GenerationRequest, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages; for a migrated request (``resume_text``) they end with the
    assistant's reply so far, left open (``continue_final_message``, set in ``body``) —
    appended to the client's own prefill when it sent one."""
    messages = list(req.messages or ())
    if not req.resume_text:
        return messages
    last = messages[-1] if messages else None
    if (
        body.get("continue_final_message")
        and last is not None
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    ):
        messages[-1] = {**last, "content": last["content"] + req.resume_text}
    else:
        messages.append({"role": "assistant", "content": req.resume_text})
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False
    return messages


def choice_delta(choice: dict[str, Any], tokens: int) -> Delta:
    """A streamed choice's output (chat ``delta`` or completion ``text``) as a delta of
    ``tokens`` tokens."""
    text = choice.get("text")  # text completions
    delta = None
    if text is None:
        delta = choice.get("delta") or {}
        text = delta.get("content")
    side: dict[str, Any] = {}
    for s in GENERATION:
        if s.choice:  # on the choice, chat or text completion
            value = choice.get(s.choice)
        elif delta is not None and s.chat:  # in a chat delta, by any name
            value = next((delta[k] for k in (s.chat, *s.chat_aliases) if delta.get(k)), None)
        else:
            continue
        if value:
            side[s.name] = value
    return Delta(text or "", tokens, **side)


def has_output(d: Delta) -> bool:
    """Whether ``d`` carries anything for the caller."""
    return bool(d.text) or any(getattr(d, s.name) for s in GENERATION)


def usage_details(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The detail objects of an OpenAI usage object, when present."""
    if not usage:
        return None
    details = {k: usage[k] for k in USAGE_DETAILS if usage.get(k)}
    return details or None


def finish_reason(reason: str | None) -> str:
    """An engine's finish reason as one of :data:`FINISH_REASONS`."""
    return reason if reason in FINISH_REASONS else "stop"


def stop_string(choice: dict[str, Any]) -> str | None:
    """The stop string that ended a finishing choice: vLLM's ``stop_reason`` when it is a
    string (an int is a stop token id, None the model's own end; other engines send none)."""
    reason = choice.get("stop_reason")
    return reason if isinstance(reason, str) else None

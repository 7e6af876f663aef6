"""The answer of a Messages request, put together from the chat stream's chunks
(:class:`MessageBuilder`): content blocks (``thinking`` from the engine's reasoning,
``text``, ``tool_use``) and, when streamed, Anthropic's events (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``) as
server-sent events (:func:`sse`); its usage (:func:`usage_of`) and stop reason
(:func:`stop_reason`). Errors take Anthropic's shape (:func:`error_body`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from bus_schemas import errors as E
from services.caller import Chunk, Usage

# The class that served a message as Anthropic's ``usage.service_tier`` names it.
ANTHROPIC_TIERS = {"priority": "priority", "default": "standard", "flex": "batch"}
_STOP = {"length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
# The error types of Anthropic's API, by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def new_message_id() -> str:
    """A fresh message id."""
    return f"msg_{uuid.uuid4().hex}"


def usage_of(u: Usage | None) -> dict[str, Any]:
    """The chat stream's usage as Anthropic's: ``input_tokens`` without the cached part,
    which is ``cache_read_input_tokens``."""
    u = u or Usage(0, 0, 0)
    cached = int((u.prompt_tokens_details or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": u.prompt_tokens - cached,
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def stop_reason(
    finish: str | None, matched: str | None, stops: list[str] | None = None
) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat ``finish_reason`` and the stop string
    the engine says ended it (``matched``): ``stop_sequence`` naming it when it is one of the
    request's ``stops`` (any, when those are not given), else ``end_turn`` (the model stopped
    on its own)."""
    if finish in _STOP:
        return _STOP[finish], None
    if matched is not None and (stops is None or matched in stops):
        return "stop_sequence", matched
    return "end_turn", None


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error JSON: ``{"type": "error", "error": {"type", "message"}}``."""
    out: dict[str, Any] = {
        "type": "error",
        "error": {"type": error_type(status), "message": message},
    }
    if request_id:
        out["request_id"] = request_id
    return out


def _input(args: str) -> dict[str, Any]:
    """A tool call's arguments as a ``tool_use`` block's ``input`` (arguments that are not a
    JSON object, cut short by max_tokens say, are kept whole under ``_arguments``)."""
    if not args.strip():
        return {}
    try:
        value = json.loads(args)
    except ValueError:
        return {"_arguments": args}
    return value if isinstance(value, dict) else {"_arguments": args}


class MessageBuilder:
    """One message put together from chat chunks: its content blocks and, with ``events``,
    Anthropic's streaming events in order.

    Blocks open as their output starts (thinking, then text, then each tool call) and close
    when another kind starts or the stream ends, so each block's ``content_block_start`` comes
    before its deltas and its ``content_block_stop`` before the next one's start."""

    def __init__(
        self,
        model: str,
        *,
        events: bool,
        stop_sequences: list[str] | None = None,
        message_id: str | None = None,
    ) -> None:
        self.id = message_id or new_message_id()
        self.model = model
        self.events = events
        self.stops = stop_sequences
        self.content: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the block being made
        self._buf: list[str] = []  # its text (or arguments) so far
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its block
        self._args: dict[int, list[str]] = {}  # and its arguments
        self._text_template = ""

    def message(self, **fields: Any) -> dict[str, Any]:
        """The message object as it stands."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": list(self.content),
            "stop_reason": None,
            "stop_sequence": None,
            **fields,
        }

    def opening(self) -> list[dict[str, Any]]:
        """``message_start`` (input tokens come in ``message_delta``) and a ``ping``."""
        usage = {"input_tokens": 0, "output_tokens": 0}
        start = {"type": "message_start", "message": self.message(usage=usage)}
        return [start, {"type": "ping"}] if self.events else []

    # -- blocks -----------------------------------------------------------------------------
    def _start(self, out: list[dict[str, Any]], block: dict[str, Any]) -> None:
        self._close(out)
        self.content.append(block)
        self._open = block
        self._buf = []
        if self.events:
            shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
            out.append(
                {"type": "content_block_start", "index": self._index, "content_block": shown}
            )
            if block["type"] == "text":
                self._text_template = (
                    'event: content_block_delta\ndata: {"type":"content_block_delta",'
                    f'"index":{self._index},'
                    '"delta":{"type":"text_delta","text":%s}}\n\n'
                )

    @property
    def _index(self) -> int:
        return len(self.content) - 1

    def _delta(self, out: list[dict[str, Any]], delta: dict[str, Any]) -> None:
        if self.events:
            out.append({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self, out: list[dict[str, Any]]) -> None:
        block = self._open
        if block is None:
            return
        said = "".join(self._buf)
        if block["type"] == "text":
            block["text"] = said
        elif block["type"] == "thinking":
            block["thinking"] = said
        if self.events:
            out.append({"type": "content_block_stop", "index": self._index})
        self._open = None
        self._buf = []

    def _in(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    # -- chunks -----------------------------------------------------------------------------
    def add(self, c: Chunk) -> list[dict[str, Any]]:
        """The events of one chunk (none when not streaming)."""
        out: list[dict[str, Any]] = []
        if c.reasoning:
            if not self._in("thinking"):
                self._start(out, {"type": "thinking", "thinking": "", "signature": ""})
            self._buf.append(c.reasoning)
            self._delta(out, {"type": "thinking_delta", "thinking": c.reasoning})
        for text in (c.text, c.refusal):
            if text:
                self._text(text, out)
        for d in c.tool_calls or ():
            self._call(d, out)
        return out

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        if not self._in("text"):
            self._start(out, {"type": "text", "text": ""})
        self._buf.append(text)
        self._delta(out, {"type": "text_delta", "text": text})

    def text_sse(self, text: str) -> str | None:
        """The SSE event of a plain text delta when a text block is open (the hot path: one
        ``%`` per token), else None."""
        if not self._in("text"):
            return None
        self._buf.append(text)
        return self._text_template % json.dumps(text)

    def _call(self, d: dict[str, Any], out: list[dict[str, Any]]) -> None:
        idx = int(d.get("index", 0))
        fn = d.get("function") or {}
        args = fn.get("arguments") or ""
        block = self._calls.get(idx)
        if block is None:
            call_id = d.get("id") or f"toolu_{self.id.removeprefix('msg_')}_{idx}"
            block = {"type": "tool_use", "id": call_id, "name": fn.get("name") or "", "input": {}}
            self._calls[idx] = block
            self._args[idx] = []
            self._start(out, block)
        self._args[idx].append(args)
        if args and block is self._open:
            self._delta(out, {"type": "input_json_delta", "partial_json": args})
        # A fragment of a call already closed (engines send calls one after another) is kept
        # in its block's input; its events have gone.

    # -- the end ----------------------------------------------------------------------------
    def finish(
        self,
        finish_reason: str | None,
        usage: Usage | None,
        stop_sequence: str | None = None,
        tier: str | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the whole message, the closing events: ``message_delta``, ``message_stop``);
        ``stop_sequence`` is the stop string the engine says ended the answer, if any;
        ``tier`` the class that served it (``usage.service_tier``)."""
        out: list[dict[str, Any]] = []
        self._close(out)
        for idx, block in self._calls.items():
            block["input"] = _input("".join(self._args[idx]))
        if not self.events:
            # An output filter holds reasoning back to the end of the generation; a whole
            # answer still puts it first, as a model thinks before it answers.
            self.content.sort(key=lambda b: b["type"] != "thinking")
        reason, seq = stop_reason(finish_reason, stop_sequence, self.stops or [])
        used = usage_of(usage)
        if tier in ANTHROPIC_TIERS:
            used["service_tier"] = ANTHROPIC_TIERS[tier]
        if self.events:
            delta = {"stop_reason": reason, "stop_sequence": seq}
            out.append({"type": "message_delta", "delta": delta, "usage": used})
            out.append({"type": "message_stop"})
        return self.message(stop_reason=reason, stop_sequence=seq, usage=used), out

    def fail(self, err: E.TokenbusError) -> list[dict[str, Any]]:
        """The ``error`` event that ends a stream which failed after it started."""
        message = err.message + (" (retryable: send the request again)" if err.retryable else "")
        return [error_body(E.http_status(err), message)]


def sse(ev: dict[str, Any]) -> str:
    """One event as server-sent event text."""
    return f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"

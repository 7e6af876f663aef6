"""The answer of a Responses request, put together from the chat stream's chunks
(:class:`ResponseBuilder`): output items (``reasoning``, ``message`` with ``output_text`` /
``refusal`` parts, ``function_call``, ``custom_tool_call``) and, when streamed, the
specification's events, each with its ``sequence_number``; what is stored of a finished
response (:func:`record`).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from bus_schemas import errors as E
from bus_schemas.side_outputs import REASONING, REFUSAL, TOOL_CALLS
from dialects.responses.translation import Turn
from services.caller import Chunk, Usage


def usage_of(u: Usage | None) -> dict[str, Any]:
    """The chat stream's usage as the Responses API's ``usage``."""
    u = u or Usage(0, 0, 0)
    prompt_details = u.prompt_tokens_details or {}
    cached = prompt_details.get("cached_tokens") or 0
    cache_write = prompt_details.get("cache_write_tokens") or 0
    reasoning = (u.completion_tokens_details or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": cache_write},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": u.total_tokens,
    }


_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _logprobs(lp: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Chat logprobs (``{"content": [...]}``) as an output_text's ``logprobs`` entries."""
    return list((lp or {}).get("content") or ())


# A complete piece of a JSON string's text: a run of plain characters, an escape, or a
# surrogate pair's two escapes (so that a pair is never decoded in halves).
_STRING_PIECE = re.compile(
    r'(?:[^"\\]+|\\["\\/bfnrt]|\\u(?![dD][89a-fA-F])[0-9a-fA-F]{4}'
    r"|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})*"
)
# The longest piece a partial one may still become (a surrogate pair's escapes).
_LONGEST_PIECE = 12


def _input_start(head: str) -> int | None:
    """Where the string value of a first key ``"input"`` starts in JSON arguments text (just
    after ``{"input": "``); -1 when the text does not start so, None while it still may."""
    at = 0
    for token in ("{", '"input"', ":", '"'):
        while at < len(head) and head[at] in " \t\r\n":
            at += 1
        got = head[at : at + len(token)]
        if not token.startswith(got):
            return -1
        if len(got) < len(token):
            return None
        at += len(token)
    return at


class _CustomInput:
    """The ``input`` of a custom tool's call, read from the engine's arguments for it as
    they come. Arguments that start ``{"input": "`` (as :func:`_custom` asks) give the
    string's text as it is decoded, so that it streams; from a point where the string is
    not valid JSON, or cut off, the input is the raw text. Other arguments are read whole at
    the end: their ``input`` when they are a JSON object with a string one, else the raw
    text. So what was given as it came is always the start of the whole input."""

    __slots__ = ("_head", "_pending", "_raw", "_sent", "_state")

    def __init__(self) -> None:
        self._raw: list[str] = []
        self._head = ""  # the text before the string starts, while that is not yet known
        self._state = "head"  # head, string, closed (the string ended), broken, other
        self._pending: list[str] = []  # string text not yet decoded (raw once broken)
        self._sent: list[str] = []

    @property
    def raw(self) -> str:
        """The arguments as the engine gave them."""
        return "".join(self._raw)

    @property
    def sent(self) -> str:
        """The input given so far by :meth:`feed`."""
        return "".join(self._sent)

    def feed(self, fragment: str) -> str:
        """Take a fragment of the arguments; the input text it completes (maybe none)."""
        self._raw.append(fragment)
        if self._state == "head":
            self._head += fragment
            start = _input_start(self._head)
            if start is None:
                return ""
            self._state = "other" if start < 0 else "string"
            fragment = self._head[start:] if start >= 0 else ""
        if self._state == "broken":
            self._pending.append(fragment)
        if self._state != "string":
            return ""
        text = "".join(self._pending) + fragment
        end = _STRING_PIECE.match(text)
        assert end is not None  # it matches the empty string
        rest = text[end.end() :]
        if rest.startswith('"'):
            self._state, rest = "closed", ""
        elif len(rest) >= _LONGEST_PIECE:
            self._state = "broken"  # not JSON: the rest is raw text
        self._pending = [rest] if rest else []
        got: str = json.loads(f'"{end.group()}"', strict=False) if end.group() else ""
        if got:
            self._sent.append(got)
        return got

    def value(self) -> str:
        """The whole input, once the arguments are all in."""
        if self._state in ("string", "broken", "closed"):
            return self.sent + "".join(self._pending)
        raw = self.raw
        try:
            args = json.loads(raw)
        except (ValueError, RecursionError):
            return raw
        given = args.get("input") if isinstance(args, dict) else None
        return given if isinstance(given, str) else raw


class ResponseBuilder:
    """One response put together from chat chunks: its output items and, with ``events``,
    the streaming events in order, numbered from 0 by ``sequence_number``.

    Items open as their output starts (reasoning, then message text or refusal, then each
    function or custom tool call) and close when another kind starts or the stream ends, so
    every item's ``added`` comes before its deltas and its ``done`` before the next item's
    ``added``.
    """

    def __init__(self, turn: Turn, *, events: bool, created_at: float | None = None) -> None:
        self.id = turn.response_id
        self.echo = turn.echo
        self.names = turn.names
        self.encrypted_reasoning = turn.encrypted_reasoning
        self._engine_names: dict[str, str] = {}  # tool call item id -> the engine's name
        self._inputs: dict[str, _CustomInput] = {}  # custom_tool_call item id -> its input
        self.created_at = int(created_at if created_at is not None else time.time())
        self.events = events
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self._hex = self.id.removeprefix("resp_")
        self._item: dict[str, Any] | None = None  # the item being made
        self._part: str | None = None  # its content part being made: output_text, refusal...
        self._buf: list[str] = []  # text of the part (or arguments of the call) so far
        self._logprobs: list[dict[str, Any]] = []
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self._text_template = ""
        self.text = ""  # the output text (output_text parts joined), once finished
        self.status = "in_progress"

    # -- events ---------------------------------------------------------------------------
    def _ev(self, out: list[dict[str, Any]], kind: str, **fields: Any) -> None:
        if self.events:
            out.append({"type": kind, "sequence_number": self.seq, **fields})
            self.seq += 1

    def response(self, status: str, **extra: Any) -> dict[str, Any]:
        """The response object as it stands (``status`` and fields given); ``usage`` only
        once there is one (OpenAI's document has no null for it)."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            **self.echo,
            "output": list(self.output),
            **extra,
        }

    def opening(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        out: list[dict[str, Any]] = []
        snap = self.response("in_progress")
        self._ev(out, "response.created", response=snap)
        self._ev(out, "response.in_progress", response=snap)
        return out

    # -- items ----------------------------------------------------------------------------
    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _open(self, out: list[dict[str, Any]], item: dict[str, Any]) -> None:
        self._close(out, "completed")
        self.output.append(item)
        self._item = item
        shown = {**item, "content": []} if "content" in item else dict(item)
        self._ev(out, "response.output_item.added", output_index=self._index, item=shown)

    def _open_part(self, out: list[dict[str, Any]], part: dict[str, Any]) -> None:
        item = self._item
        assert item is not None
        self._close_part(out)
        self._part = part["type"]
        self._buf = []
        item["content"].append(part)
        self._ev(
            out,
            "response.content_part.added",
            item_id=item["id"],
            output_index=self._index,
            content_index=len(item["content"]) - 1,
            part=dict(part),
        )
        if self._part == "output_text" and self.events:
            self._text_template = (
                'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                f'"item_id":"{item["id"]}","output_index":{self._index},'
                f'"content_index":{len(item["content"]) - 1},'
                '"delta":%s,"logprobs":[],"sequence_number":%d}\n\n'
            )

    def _close_part(self, out: list[dict[str, Any]]) -> None:
        item, kind = self._item, self._part
        if item is None or kind is None:
            return
        part = item["content"][-1]
        text = "".join(self._buf)
        ids = {"item_id": item["id"], "output_index": self._index}
        ci = len(item["content"]) - 1
        if kind == "output_text":
            part["text"] = text
            part["logprobs"] = self._logprobs
            self._ev(
                out,
                "response.output_text.done",
                **ids,
                content_index=ci,
                text=text,
                logprobs=self._logprobs,
            )
            self.text += text
        elif kind == "refusal":
            part["refusal"] = text
            self._ev(out, "response.refusal.done", **ids, content_index=ci, refusal=text)
        else:  # reasoning_text
            part["text"] = text
            self._ev(out, "response.reasoning_text.done", **ids, content_index=ci, text=text)
        self._ev(out, "response.content_part.done", **ids, content_index=ci, part=dict(part))
        self._part = None
        self._buf = []
        self._logprobs = []

    def _close(self, out: list[dict[str, Any]], status: str) -> None:
        item = self._item
        if item is None:
            return
        if item["type"] == "function_call":
            item["arguments"] = "".join(self._buf)
            self._ev(
                out,
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=self._index,
                name=item["name"],
                arguments=item["arguments"],
            )
            self._buf = []
        elif item["type"] == "custom_tool_call":
            given = self._inputs[item["id"]]
            item["input"] = given.value()
            ids = {"item_id": item["id"], "output_index": self._index}
            rest = item["input"][len(given.sent) :]  # what feed could not give as it came
            if rest:
                self._ev(out, "response.custom_tool_call_input.delta", **ids, delta=rest)
            self._ev(out, "response.custom_tool_call_input.done", **ids, input=item["input"])
        else:
            self._close_part(out)
        item["status"] = status
        shown = {**item, "content": list(item["content"])} if "content" in item else dict(item)
        self._ev(out, "response.output_item.done", output_index=self._index, item=shown)
        self._item = None

    def _in(self, kind: str) -> bool:
        return self._item is not None and self._item["type"] == kind

    # -- chunks ---------------------------------------------------------------------------
    def add(self, c: Chunk) -> list[dict[str, Any]]:
        """The events of one chunk (none when not streaming)."""
        out: list[dict[str, Any]] = []
        if c.reasoning:
            self.reasoning(c.reasoning, out)
        if c.text or c.logprobs:
            self._text(c.text, c.logprobs, out)
        if c.refusal:
            self._refusal(c.refusal, out)
        for d in c.tool_calls or ():
            self._call(d, out)
        return out

    def text_sse(self, text: str) -> str | None:
        """The SSE event of a plain text delta when the text part is open (the hot path:
        one ``%`` per token), else None."""
        if self._part != "output_text":
            return None
        self._buf.append(text)
        s = self._text_template % (json.dumps(text), self.seq)
        self.seq += 1
        return s

    def reasoning(self, text: str, out: list[dict[str, Any]]) -> None:
        if not self._in("reasoning"):
            self._open(
                out,
                {
                    "id": f"rs_{self._hex}_{len(self.output)}",
                    "type": "reasoning",
                    "summary": [],
                    "content": [],
                    # No encrypted reasoning here: the text is in `content`, which a client
                    # sends back as it is (asked for, the field says so with null).
                    **({"encrypted_content": None} if self.encrypted_reasoning else {}),
                    "status": "in_progress",
                },
            )
            self._open_part(out, {"type": "reasoning_text", "text": ""})
        self._buf.append(text)
        self._ev(
            out,
            REASONING.responses,
            item_id=self._item_id,
            output_index=self._index,
            content_index=self._ci,
            delta=text,
        )

    @property
    def _item_id(self) -> str:
        assert self._item is not None
        return str(self._item["id"])

    @property
    def _ci(self) -> int:
        assert self._item is not None
        return len(self._item["content"]) - 1

    def _message(self, out: list[dict[str, Any]]) -> None:
        if not self._in("message"):
            self._open(
                out,
                {
                    "id": f"msg_{self._hex}_{len(self.output)}",
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                },
            )

    def _text(self, text: str, lp: dict[str, Any] | None, out: list[dict[str, Any]]) -> None:
        self._message(out)
        if self._part != "output_text":
            self._open_part(
                out, {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            )
        entries = _logprobs(lp)
        self._logprobs.extend(entries)
        if text or entries:
            self._buf.append(text)
            self._ev(
                out,
                "response.output_text.delta",
                item_id=self._item_id,
                output_index=self._index,
                content_index=self._ci,
                delta=text,
                logprobs=entries,
            )

    def _refusal(self, text: str, out: list[dict[str, Any]]) -> None:
        self._message(out)
        if self._part != "refusal":
            self._open_part(out, {"type": "refusal", "refusal": ""})
        self._buf.append(text)
        self._ev(
            out,
            REFUSAL.responses,
            item_id=self._item_id,
            output_index=self._index,
            content_index=self._ci,
            delta=text,
        )

    def _call(self, d: dict[str, Any], out: list[dict[str, Any]]) -> None:
        idx = int(d.get("index", 0))
        fn = d.get("function") or {}
        item = self._calls.get(idx)
        if item is None:
            engine_name = fn.get("name") or ""
            ns, name = self.names.to_client.get(engine_name, ("", engine_name))
            custom = engine_name in self.names.custom
            item = {
                "id": f"{'ctc' if custom else 'fc'}_{self._hex}_{len(self.output)}",
                "type": "custom_tool_call" if custom else "function_call",
                "status": "in_progress",
                "call_id": d.get("id") or f"call_{self._hex}_{idx}",
                "name": name,
                **({"namespace": ns} if ns else {}),  # "": a renamed plain tool's
                **({"input": ""} if custom else {"arguments": ""}),
            }
            self._engine_names[item["id"]] = engine_name
            if custom:
                self._inputs[item["id"]] = _CustomInput()
            self._calls[idx] = item
            self._open(out, item)
            self._buf = []
        elif item is not self._item:
            # A fragment of a call already closed (engines send calls one after another):
            # kept in the item; its done event has gone.
            if item["type"] == "custom_tool_call":
                self._inputs[item["id"]].feed(fn.get("arguments") or "")
                item["input"] = self._inputs[item["id"]].value()
            else:
                item["arguments"] += fn.get("arguments") or ""
            return
        args = fn.get("arguments") or ""
        if args and item["type"] == "custom_tool_call":
            text = self._inputs[item["id"]].feed(args)
            if text:
                self._ev(
                    out,
                    "response.custom_tool_call_input.delta",
                    item_id=item["id"],
                    output_index=self._index,
                    delta=text,
                )
        elif args:
            self._buf.append(args)
            self._ev(
                out,
                TOOL_CALLS.responses,
                item_id=item["id"],
                output_index=self._index,
                delta=args,
            )

    # -- the end --------------------------------------------------------------------------
    def finish(
        self, finish_reason: str | None, usage: Usage | None, tier: str | None = None
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the final response object, the closing events): ``response.completed``, or
        ``response.incomplete`` when the output was cut (max_output_tokens, content filter);
        ``tier``: the ``service_tier`` that served it."""
        out: list[dict[str, Any]] = []
        reason = _INCOMPLETE.get(finish_reason or "stop")
        self._close(out, "incomplete" if reason else "completed")
        self.status = "incomplete" if reason else "completed"
        if not self.events:
            # An output filter holds reasoning back to the end of the generation; a whole
            # answer still puts it first, as a model thinks before it answers (a streamed one
            # keeps the order its events had).
            self.output.sort(key=lambda item: item["type"] != "reasoning")
        resp = self.response(
            self.status,
            usage=usage_of(usage),
            incomplete_details={"reason": reason} if reason else None,
            **({"completed_at": int(time.time())} if not reason else {}),
            **({"service_tier": tier} if tier else {}),
        )
        self._ev(out, f"response.{self.status}", response=resp)
        return resp, out

    def fail(self, err: E.TokenbusError) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the failed response, its events: ``error``, then ``response.failed`` whose
        ``response.error`` has the code and message; a retryable failure says so)."""
        out: list[dict[str, Any]] = []
        self._close(out, "incomplete")
        self.status = "failed"
        message = err.message + (" (retryable: send the request again)" if err.retryable else "")
        error = {"code": err.code, "message": message}
        self._ev(out, "error", code=err.code, message=message, param=err.param)
        resp = self.response("failed", error=error)
        self._ev(out, "response.failed", response=resp)
        return resp, out

    def assistant_messages(self) -> list[dict[str, Any]]:
        """The output as chat messages, for the conversation's history."""
        msg: dict[str, Any] = {"role": "assistant", "content": None}
        texts: list[str] = []
        for item in self.output:
            if item["type"] == "reasoning":
                msg["reasoning_content"] = "".join(p["text"] for p in item["content"])
            elif item["type"] == "message":
                for p in item["content"]:
                    if p["type"] == "output_text":
                        texts.append(p["text"])
                    elif p["type"] == "refusal":
                        msg["refusal"] = p["refusal"]
            elif item["type"] in ("function_call", "custom_tool_call"):
                args = (
                    self._inputs[item["id"]].raw  # as the engine made them
                    if item["type"] == "custom_tool_call"
                    else item["arguments"]
                )
                msg.setdefault("tool_calls", []).append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {
                            "name": self._engine_names.get(item["id"], item["name"]),
                            "arguments": args,
                        },
                    }
                )
        if texts:
            msg["content"] = "".join(texts)
        return [msg]


# -- the stored conversation -----------------------------------------------------------------
def record(
    turn: Turn, builder: ResponseBuilder, response: dict[str, Any], owner: str
) -> dict[str, Any]:
    """What is stored of a finished response: its owner, the response object, this
    request's input items, and the conversation (chat messages, output included) that a
    later request with ``previous_response_id`` continues."""
    return {
        "owner": owner,
        "response": response,
        "input_items": turn.items,
        "messages": [*turn.history, *builder.assistant_messages()],
    }

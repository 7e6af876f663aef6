"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a
dialect of one chat request.

A Messages request becomes a chat completion request (:func:`translate`): ``system`` a
system message; each message's content blocks chat content (``text``, ``image`` as an
``image_url`` part, ``document`` as a ``file`` or text part), an assistant's ``tool_use``
blocks its ``tool_calls`` and its ``thinking`` its ``reasoning_content``, a user's
``tool_result`` blocks ``tool`` messages; ``tools`` (``input_schema``) function tools,
``tool_choice`` chat's (``any`` is ``required``); ``stop_sequences`` ``stop``;
``metadata.user_id`` ``user``; ``thinking`` the chat template's switch. Fields it does not
know are carried to the engine as the chat path carries them.

The answer goes the other way (:class:`MessageBuilder`): the chat stream's chunks become
content blocks (``thinking`` from the engine's reasoning, ``text``, ``tool_use``) and, when
streamed, Anthropic's events (``message_start``, ``content_block_start`` / ``_delta`` /
``_stop``, ``message_delta``, ``message_stop``). Errors take Anthropic's shape
(:func:`error_body`). The HTTP bridge (:mod:`gateway.messages`) and the NATS client
(:meth:`tokenbus.Client.messages`) share this module; :class:`MessageStream` is the NATS
client's stream of events (on :class:`dialects.stream.ClientStream`, as the Responses one is).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from bus_schemas import errors as E
from dialects.stream import ClientStream
from services.caller import Chunk, Stream, Usage

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
# The class that served a message as Anthropic's ``usage.service_tier`` names it.
ANTHROPIC_TIERS = {"priority": "priority", "default": "standard", "flex": "batch"}
# Anthropic's ``service_tier`` as a class asked for: ``auto`` is the key's default
# (docs/flow.md), ``standard_only`` never priority.
_ASKED_TIERS = {"auto": None, "standard_only": "default"}

# Messages fields this module turns into chat fields (or acts on itself); the others of a
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
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
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


# -- content blocks → chat content -----------------------------------------------------------
def _text(block: dict[str, Any], path: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{path}.text", "a text block needs a string 'text'")
    return text


def _image(block: dict[str, Any], path: str) -> dict[str, Any]:
    """An ``image`` block as chat's ``image_url`` part (base64 data becomes a data: URL)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{path}.source", "an image block needs a source object")
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str) or not data:
            raise _bad(f"{path}.source", "a base64 source needs a media_type and data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise _bad(f"{path}.source.url", "a url source needs a url")
        return {"type": "image_url", "image_url": {"url": url}}
    raise _bad(
        f"{path}.source.type",
        f"the image source {kind!r} is not served (base64, url, or file: the file_id of an "
        "image in the key's OpenAI files, /v1/files)",
    )


def _document(block: dict[str, Any], path: str) -> dict[str, Any]:
    """A ``document`` block: plain text as a text part, a base64 PDF as chat's ``file``."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if isinstance(source, dict) and kind == "text" and isinstance(source.get("data"), str):
        return {"type": "text", "text": source["data"]}
    if isinstance(source, dict) and kind == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") or "application/pdf"
        file: dict[str, Any] = {"file_data": f"data:{media};base64,{source['data']}"}
        if isinstance(block.get("title"), str):
            file["filename"] = block["title"]
        return {"type": "file", "file": file}
    raise _bad(
        f"{path}.source",
        "a document needs a text, base64 or file source (file: the file_id of a file in the "
        "key's OpenAI files, /v1/files); url sources are not served",
    )


def _part(block: Any, path: str, *, images: bool = True) -> dict[str, Any]:
    """One user content block (or a tool result's) as a chat content part."""
    if not isinstance(block, dict):
        raise _bad(path, "a content block must be an object")
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": _text(block, path)}
    if kind == "image" and images:
        return _image(block, path)
    if kind == "document" and images:
        return _document(block, path)
    raise _bad(f"{path}.type", f"the content block type {kind!r} is not served here")


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat content: parts that are all text become one string (joined by newlines, as vLLM
    joins text parts), what every chat template reads."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _tool_result(block: dict[str, Any], path: str) -> dict[str, Any]:
    """A ``tool_result`` block as a chat ``tool`` message; an error result says so first."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{path}.tool_use_id", "a tool_result needs the tool_use_id it answers")
    raw = block.get("content", "")
    if isinstance(raw, str):
        parts = [{"type": "text", "text": raw}]
    elif isinstance(raw, list):
        parts = [_part(b, f"{path}.content.{i}") for i, b in enumerate(raw)]
    else:
        raise _bad(f"{path}.content", "a tool_result's content is a string or a list of blocks")
    if block.get("is_error") is True:
        parts.insert(0, {"type": "text", "text": "Error:"})
    return {"role": "tool", "tool_call_id": call_id, "content": _content(parts)}


def _assistant(blocks: list[Any], path: str) -> dict[str, Any]:
    """An assistant turn's blocks as one chat message: text the content, ``tool_use`` its
    tool calls, ``thinking`` its reasoning (``redacted_thinking``, Anthropic's encrypted
    reasoning, means nothing to another model and is left out)."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        p = f"{path}.{i}"
        if not isinstance(block, dict):
            raise _bad(p, "a content block must be an object")
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, p))
        elif kind == "thinking":
            said = block.get("thinking")
            if not isinstance(said, str):
                raise _bad(f"{p}.thinking", "a thinking block needs a string 'thinking'")
            reasoning.append(said)
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{p}.id", "a tool_use block needs an id")
            if not isinstance(name, str) or not name:
                raise _bad(f"{p}.name", "a tool_use block needs the tool's name")
            if not isinstance(args, dict):
                raise _bad(f"{p}.input", "a tool_use block's input is an object")
            fn = {"name": name, "arguments": json.dumps(args)}
            calls.append({"id": call_id, "type": "function", "function": fn})
        else:
            raise _bad(
                f"{p}.type",
                f"the assistant block type {kind!r} is not served (tokenbus serves text, "
                "thinking, redacted_thinking and tool_use)",
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    return msg


def _user(blocks: list[Any], path: str) -> list[dict[str, Any]]:
    """A user turn's blocks: its tool results as ``tool`` messages (they answer the turn
    before, so they come first), then the rest as one user message."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        p = f"{path}.{i}"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            tools.append(_tool_result(block, p))
        else:
            parts.append(_part(block, p))
    return [*tools, *([{"role": "user", "content": _content(parts)}] if parts else [])]


def to_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a Messages ``messages`` list."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        p = f"messages.{i}"
        if not isinstance(m, dict):
            raise _bad(p, "a message must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"{p}.role", "the role must be 'user', 'assistant' or 'system'")
        if role == "system":
            # Claude Code (2.1.x) sends system messages between the turns (its agent list, say):
            # a chat system message where it stands.
            if not isinstance(content, str | list):
                raise _bad(f"{p}.content", "content must be a string or a list of text blocks")
            out.append({"role": "system", "content": _system(content, f"{p}.content") or ""})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise _bad(f"{p}.content", "content must be a string or a list of content blocks")
        elif role == "assistant":
            out.append(_assistant(content, f"{p}.content"))
        else:
            out.extend(_user(content, f"{p}.content"))
    return out


def _system(system: str | list[Any] | None, path: str = "system") -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _bad(f"{path}.{i}", "system blocks are text blocks")
        texts.append(_text(block, f"{path}.{i}"))
    return "\n".join(texts) or None


# -- tools, the chat body ---------------------------------------------------------------------
def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        p = f"tools.{i}"
        if not isinstance(t, dict):
            raise _bad(p, "a tool must be an object")
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise _bad(
                f"{p}.type",
                f"the server tool {kind!r} is not served by tokenbus: only client tools (a "
                "name and an input_schema) are; run the tool yourself and send a tool_result",
            )
        name = t.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{p}.name", "a tool needs a name of 1-64 letters, digits, '_', '.' or '-'")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{p}.input_schema", "a tool needs an input_schema (a JSON Schema object)")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if isinstance(t.get("strict"), bool):
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any], names: set[str]) -> str | dict[str, Any]:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        if not names:
            raise _bad("tool_choice", "'any' needs tools")
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise _bad("tool_choice.name", f"names {name!r}, which is not in tools")
        return {"type": "function", "function": {"name": name}}
    raise _bad("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")


def _thinking(thinking: dict[str, Any], max_tokens: int) -> bool | None:
    """Whether the engine is asked to think (None: as its template decides)."""
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind in ("adaptive", "between_tools"):
        return True
    if kind != "enabled":
        raise _bad("thinking.type", "must be 'enabled', 'disabled', 'adaptive' or 'between_tools'")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise _bad("thinking.budget_tokens", "'enabled' needs a budget_tokens of at least 1")
    if budget >= max_tokens:
        raise _bad("thinking.budget_tokens", "must be less than max_tokens")
    return True


def _output_config(config: dict[str, Any], chat: dict[str, Any]) -> None:
    """``output_config``: ``effort`` the chat ``reasoning_effort`` (``xhigh`` and ``max`` are
    ``high``, the most chat has), ``format`` (a JSON schema) the ``response_format``."""
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise _bad("output_config.effort", f"must be one of {', '.join(EFFORTS)}")
        chat["reasoning_effort"] = EFFORTS[effort]
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise _bad("output_config.format.type", "must be 'json_schema'")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("output_config.format.schema", "a json_schema format needs a schema object")
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        }


def translate(req: MessagesRequest, body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request (its JSON body) for a Messages request."""
    if not req.messages:
        raise _bad("messages", "the conversation is empty: send at least one message")
    messages = to_messages(req.messages)
    system = _system(req.system)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in OWNED}
    chat["model"] = req.model
    chat["messages"] = messages
    chat["max_tokens"] = req.max_tokens
    tier = body.get("service_tier")
    if tier is not None:
        if not isinstance(tier, str) or tier not in _ASKED_TIERS:
            raise _bad("service_tier", f"{tier!r} is not a service tier (auto, standard_only)")
        if _ASKED_TIERS[tier]:
            chat["service_tier"] = _ASKED_TIERS[tier]
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.stop_sequences:
        chat["stop"] = list(req.stop_sequences)
    meta = req.metadata or {}
    for key in meta:
        if key != "user_id":
            raise _bad(f"metadata.{key}", "the only metadata is user_id")
    if meta.get("user_id") is not None:
        if not isinstance(meta["user_id"], str):
            raise _bad("metadata.user_id", "must be a string")
        chat["user"] = meta["user_id"]
    tools = _tools(req.tools) if req.tools else []
    if tools:
        chat["tools"] = tools
    if req.tool_choice is not None:
        names = {t["function"]["name"] for t in tools}
        chat["tool_choice"] = _tool_choice(req.tool_choice, names)
        if req.tool_choice.get("disable_parallel_tool_use") is True and tools:
            chat["parallel_tool_calls"] = False
    think = _thinking(req.thinking, req.max_tokens) if req.thinking is not None else None
    if think is not None:
        # The switch chat templates read: Qwen's enable_thinking, DeepSeek's thinking; what
        # the request's own chat_template_kwargs say wins.
        kwargs = chat.get("chat_template_kwargs")
        own = kwargs if isinstance(kwargs, dict) else {}
        chat["chat_template_kwargs"] = {"enable_thinking": think, "thinking": think, **own}
    _output_config(req.output_config or {}, chat)
    if messages[-1]["role"] == "assistant":
        # A last assistant turn is a prefill the answer continues (vLLM's way to say so).
        chat.setdefault("continue_final_message", True)
        chat.setdefault("add_generation_prompt", False)
    return chat


def count_request(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat request that counts a ``count_tokens`` request's tokens: the same prompt,
    one token made; the engine's ``prompt_tokens`` is the count."""
    out = {k: v for k, v in chat.items() if k not in ("stop", "continue_final_message")}
    out["max_tokens"] = 1
    return out


# -- chunks → content blocks and events --------------------------------------------------------
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


# -- the NATS client's stream ------------------------------------------------------------------
class MessageStream(ClientStream):
    """A Messages answer over NATS: an async iterator of the streaming events (dicts with
    ``type``, as the HTTP API sends them); ``message`` is the whole message once they end.
    :meth:`collect` reads it whole. A failure raises its typed error (the ``error`` event of
    the HTTP stream), as Anthropic's SDK raises on one."""

    def __init__(
        self, req: MessagesRequest, body: dict[str, Any], submit: Callable[[dict[str, Any]], Stream]
    ) -> None:
        # Translated now, so that a bad field is refused at the call, before any event.
        self.chat = translate(req, body)
        self.builder = MessageBuilder(req.model, events=True, stop_sequences=req.stop_sequences)
        self.message: dict[str, Any] | None = None
        super().__init__(submit)

    @property
    def id(self) -> str:
        """The message's id."""
        return self.builder.id

    async def _events(self) -> AsyncGenerator[dict[str, Any], None]:
        stream = self.stream = self._submit(self.chat)
        b = self.builder
        try:
            for ev in b.opening():
                yield ev
            async for c in stream:
                for ev in b.add(c):
                    yield ev
            self.message, events = b.finish(
                stream.finish_reason, stream.usage, stream.stop_sequence, stream.service_tier
            )
            for ev in events:
                yield ev
        finally:
            await stream.aclose()

    def _whole(self) -> dict[str, Any] | None:
        return self.message

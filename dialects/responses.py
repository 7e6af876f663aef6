"""The OpenAI Responses API (``POST /v1/responses``) translated onto the chat path.

A Responses request becomes a chat completion request (:func:`translate`): ``instructions``
a system message; the ``input`` items chat messages (``function_call`` items an assistant's
``tool_calls``, ``function_call_output`` items tool messages, ``reasoning`` items the next
assistant turn's ``reasoning_content``); function tools and ``tool_choice`` in chat's shape
(the function tools of a ``namespace`` tool flattened, their calls given back under their
namespace: :class:`ToolNames`; a ``custom`` tool a function with one string parameter,
``input``, its calls given back as ``custom_tool_call`` items; hosted web search left out);
``text.format`` the ``response_format``; ``max_output_tokens`` the
``max_completion_tokens``; ``reasoning.effort`` the ``reasoning_effort``; every other field
is carried as the chat path carries it. So routing, keys, limits, the content filter,
migration and telemetry are the chat path's, with no second path to keep equal to it.

The answer goes the other way (:class:`ResponseBuilder`): the chat stream's chunks become
output items (``reasoning``, ``message`` with ``output_text`` / ``refusal`` parts,
``function_call``, ``custom_tool_call``) and, when streamed, the specification's events,
each with its ``sequence_number``. The HTTP bridge (:mod:`gateway.responses`) and the NATS
client (:meth:`tokenbus.Client.responses`) share this module; :class:`ResponseStream` is
the NATS client's stream of events.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from bus_schemas import errors as E
from bus_schemas.messages import whole_numbers
from services.caller import Chunk, Stream, Usage

Strict01 = Annotated[float, Field(strict=True)]

# Responses fields this module turns into chat fields (or acts on itself); the others of a
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
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
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


def _union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _bad(param: str, message: str) -> E.InvalidRequest:
    return E.InvalidRequest(f"{param}: {message}", param=param)


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
        first = exc.errors()[0]
        # pydantic names the member of a union that failed (input.str): the field is enough.
        loc = ".".join(str(p) for p in first.get("loc", ()) if not _union_tag(p))
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
        raise E.InvalidRequest(f"{loc or 'body'}: {msg}{more}", param=loc or None) from None
    if req.truncation == "auto":
        raise _bad(
            "truncation",
            "'auto' (dropping the oldest input to fit the context) is not served by tokenbus; "
            "send 'disabled' or leave it out (a prompt too long for the model is a 400)",
        )
    return req


# -- input items → chat messages ------------------------------------------------------------
def _text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _content_part(part: Any, path: str) -> dict[str, Any]:
    """One Responses content part as a chat content part."""
    if not isinstance(part, dict):
        raise _bad(path, "a content part must be an object")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{path}.text", f"a {kind} part needs a string 'text'")
        return _text_part(text)
    if kind == "refusal":
        refusal = part.get("refusal")
        if not isinstance(refusal, str):
            raise _bad(f"{path}.refusal", "a refusal part needs a string 'refusal'")
        return {"type": "refusal", "refusal": refusal}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            what = "file_id (tokenbus has no Files API)" if part.get("file_id") else "no image_url"
            raise _bad(
                f"{path}.image_url",
                f"an input_image needs an image_url (a URL or a data: URL); this one has {what}",
            )
        image: dict[str, Any] = {"url": url}
        if part.get("detail") is not None:
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        data = part.get("file_data")
        if not isinstance(data, str) or not data:
            raise _bad(
                f"{path}.file_data",
                "an input_file needs file_data (tokenbus has no Files API, so file_id and "
                "file_url are not served)",
            )
        file: dict[str, Any] = {"file_data": data}
        if isinstance(part.get("filename"), str):
            file["filename"] = part["filename"]
        return {"type": "file", "file": file}
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            raise _bad(f"{path}.input_audio", "an input_audio part needs an input_audio object")
        return {"type": "input_audio", "input_audio": audio}
    raise _bad(f"{path}.type", f"the content part type {kind!r} is not served")


def _content(content: Any, path: str) -> str | list[dict[str, Any]]:
    """A message's content: a string stays one; parts become chat parts, and parts that are
    all text become one string (what every chat template reads)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(path, "content must be a string or a list of content parts")
    parts = [_content_part(p, f"{path}.{i}") for i, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


ROLES = ("user", "system", "developer", "assistant")


@dataclass(slots=True)
class Turn:
    """One request translated: the chat body, and what is stored of it."""

    chat: dict[str, Any]  # the chat completion request body
    history: list[dict[str, Any]]  # chat messages of the conversation, without instructions
    items: list[dict[str, Any]]  # this request's input items as stored (each with an id)
    response_id: str
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats
    names: ToolNames = field(default_factory=lambda: ToolNames())  # namespaced tools' names
    session: str | None = None  # the session key for routing (prompt_cache_key)
    encrypted_reasoning: bool = False  # include asks for reasoning.encrypted_content


_CHAT_NAME_BAD = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(slots=True)
class ToolNames:
    """The names of a request's namespaced tools: each inner tool of a ``namespace`` tool
    is a chat function tool named ``<namespace>__<name>`` (characters chat names do not allow
    as ``_``; too long, or taken, shortened with a hash), and this table maps both ways, so
    a call comes back under the name and namespace the client gave, never by parsing.
    A custom tool named as a function tool of the request is renamed the same way, under the
    namespace ``""`` (none). ``custom``: the chat names of the request's custom tools (plain
    or namespaced), whose calls come back as ``custom_tool_call`` items."""

    to_engine: dict[tuple[str, str], str] = field(default_factory=dict)
    to_client: dict[str, tuple[str, str]] = field(default_factory=dict)
    custom: set[str] = field(default_factory=set)

    def add(self, namespace: str, name: str, taken: set[str]) -> str:
        """The chat name of ``name`` in ``namespace`` (a new one, not in ``taken``)."""
        flat = flat_name(namespace, name)
        if flat in taken:
            flat = flat_name(namespace, name, hashed=True)
        taken.add(flat)
        self.to_engine[(namespace, name)] = flat
        self.to_client[flat] = (namespace, name)
        return flat

    def engine(self, namespace: str, name: str) -> str:
        """The chat name the engine knows a namespaced tool by (a tool not in this request's
        tools: the name it had when it was in one)."""
        return self.to_engine.get((namespace, name)) or flat_name(namespace, name)


def flat_name(namespace: str, name: str, *, hashed: bool = False) -> str:
    """``<namespace>__<name>`` as a chat tool name (``^[a-zA-Z0-9_-]{1,64}$``)."""
    flat = _CHAT_NAME_BAD.sub("_", f"{namespace}__{name}")
    if hashed or len(flat) > 64:
        digest = hashlib.sha256(f"{namespace}\0{name}".encode()).hexdigest()[:8]
        flat = f"{flat[:55]}_{digest}"
    return flat


def new_response_id() -> str:
    """A fresh response id: random, so no client can choose one that names another's."""
    return f"resp_{uuid.uuid4().hex}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Messages:
    """Chat messages built from input items, merging an assistant turn's pieces."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.reasoning: list[str] = []
        self._open_assistant: dict[str, Any] | None = None  # may still take tool calls

    def add(self, msg: dict[str, Any]) -> None:
        if msg["role"] == "assistant" and self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
            self.reasoning = []
        self.out.append(msg)
        self._open_assistant = msg if msg["role"] == "assistant" else None

    def call(self, call: dict[str, Any]) -> None:
        a = self._open_assistant
        if a is None:
            a = {"role": "assistant", "content": None}
            self.add(a)
        a.setdefault("tool_calls", []).append(call)


def _unanswered(messages: list[dict[str, Any]]) -> list[str]:
    """The ids of the tool calls in ``messages`` that no tool message answers yet, in order."""
    calls: list[str] = []
    for m in messages:
        if m.get("role") == "assistant":
            calls.extend(str(c.get("id")) for c in m.get("tool_calls") or ())
        elif m.get("role") == "tool" and m.get("tool_call_id") in calls:
            calls.remove(m["tool_call_id"])
    return calls


def to_messages(
    items: str | list[Any],
    path: str = "input",
    before: list[dict[str, Any]] | None = None,
    names: ToolNames | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat messages, stored input items) of a Responses ``input``; ``before``: the chat
    messages of the conversation so far (a ``function_call_output`` without ``call_id``
    answers the first call that has no output yet); ``names``: the request's namespaced
    tools (a ``function_call`` with a ``namespace`` is made under its chat name). A
    ``custom_tool_call`` is a call whose arguments are ``{"input": ...}``, as the engine
    made it (:func:`_custom`); a ``custom_tool_call_output`` a tool message."""
    if isinstance(items, str):
        item = {
            "id": _item_id("msg"),
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": items}],
        }
        return [{"role": "user", "content": items}], [item]
    msgs = _Messages()
    stored: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        p = f"{path}.{i}"
        if not isinstance(item, dict):
            raise _bad(p, "an input item must be an object")
        # No type: a message (it has a role) or a reference to an item (an id alone).
        kind = item.get("type", "message" if "role" in item else "item_reference")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{p}.role", f"the role must be one of {', '.join(ROLES)}")
            if "content" not in item:
                raise _bad(f"{p}.content", "a message needs content")
            content = _content(item["content"], f"{p}.content")
            msg: dict[str, Any] = {"role": role, "content": content}
            if role == "assistant" and isinstance(content, list):
                # An assistant's refusal part is chat's `refusal`; its text the content.
                text = "".join(c.get("text", "") for c in content if c["type"] == "text")
                refusal = "".join(c.get("refusal", "") for c in content if c["type"] == "refusal")
                if len(content) == sum(c["type"] in ("text", "refusal") for c in content):
                    msg = {"role": role, "content": text or None}
                    if refusal:
                        msg["refusal"] = refusal
            msgs.add(msg)
            stored.append(_stored_message(item, role))
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not isinstance(call_id, str):
                raise _bad(f"{p}.call_id", "a function_call needs a call_id")
            if not isinstance(name, str):
                raise _bad(f"{p}.name", "a function_call needs the function's name")
            if not isinstance(args, str):
                raise _bad(f"{p}.arguments", "a function_call's arguments are a JSON string")
            namespace = item.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise _bad(f"{p}.namespace", "a function_call's namespace is a string")
            namespace = namespace or None  # "": no namespace (the default one)
            engine_name = (
                name if namespace is None else (names or ToolNames()).engine(namespace, name)
            )
            msgs.call(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": engine_name, "arguments": args},
                }
            )
            stored.append(
                {
                    "id": item.get("id") or _item_id("fc"),
                    "type": "function_call",
                    "call_id": call_id,
                    "name": name,
                    **({"namespace": namespace} if namespace is not None else {}),
                    "arguments": args,
                    "status": "completed",
                }
            )
        elif kind == "custom_tool_call":
            call_id, name, given = item.get("call_id"), item.get("name"), item.get("input")
            if not isinstance(call_id, str):
                raise _bad(f"{p}.call_id", "a custom_tool_call needs a call_id")
            if not isinstance(name, str):
                raise _bad(f"{p}.name", "a custom_tool_call needs the tool's name")
            if not isinstance(given, str):
                raise _bad(f"{p}.input", "a custom_tool_call's input is a string")
            namespace = item.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise _bad(f"{p}.namespace", "a custom_tool_call's namespace is a string")
            namespace = namespace or None
            table = names or ToolNames()
            engine_name = (
                table.to_engine.get(("", name), name)  # renamed when a function has its name
                if namespace is None
                else table.engine(namespace, name)
            )
            args = json.dumps({"input": given}, ensure_ascii=False)
            msgs.call(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": engine_name, "arguments": args},
                }
            )
            stored.append(
                {
                    "id": item.get("id") or _item_id("ctc"),
                    "type": "custom_tool_call",
                    "call_id": call_id,
                    "name": name,
                    **({"namespace": namespace} if namespace is not None else {}),
                    "input": given,
                    "status": "completed",
                }
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id, output = item.get("call_id"), item.get("output")
            if call_id is None:  # the first call without an output (if any) is the one
                call_id = next(iter(_unanswered([*(before or ()), *msgs.out])), None)
            elif not isinstance(call_id, str):  # "" is an id, as a function_call's may be
                raise _bad(f"{p}.call_id", f"the call_id of a {kind} is a string")
            if not isinstance(output, str | list):
                raise _bad(f"{p}.output", "the output must be a string or a list of parts")
            tool: dict[str, Any] = {"role": "tool", "content": _content(output, f"{p}.output")}
            answered: dict[str, Any] = {}
            if call_id is not None:
                tool["tool_call_id"] = answered["call_id"] = call_id
            msgs.add(tool)
            stored.append(
                {
                    "id": item.get("id")
                    or _item_id("fco" if kind == "function_call_output" else "ctco"),
                    "type": kind,
                    **answered,
                    "output": output,
                    "status": "completed",
                }
            )
        elif kind == "reasoning":
            said, summary = _texts(item.get("content")), _texts(item.get("summary"))
            # Carried to the next assistant turn, as the chat path carries reasoning.
            msgs.reasoning.append("".join(said) if said else "\n".join(summary))
            stored.append({**item, "id": item.get("id") or _item_id("rs")})
        elif kind == "item_reference":
            raise _bad(
                f"{p}.type",
                "item references are not served; send the item itself or use previous_response_id",
            )
        else:
            raise _bad(
                f"{p}.type",
                f"the input item type {kind!r} is not served (tokenbus serves message, "
                "function_call, function_call_output, custom_tool_call, custom_tool_call_output "
                "and reasoning items)",
            )
    return msgs.out, stored


def _texts(parts: Any) -> list[str]:
    """The ``text`` of each part of a list of parts (a reasoning item's content, summary)."""
    if not isinstance(parts, list):
        return []
    return [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]


def _stored_message(item: dict[str, Any], role: str) -> dict[str, Any]:
    content = item["content"]
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    return {
        "id": item.get("id") or _item_id("msg"),
        "type": "message",
        "role": role,
        "content": content,
        "status": "completed",
    }


# -- tools, formats, the chat body ----------------------------------------------------------
def _function(t: dict[str, Any], p: str, name: str | None = None) -> dict[str, Any]:
    """A function tool in chat's shape (``name``: its chat name, when not its own)."""
    own = t.get("name")
    if not isinstance(own, str) or not _NAME.match(own):
        raise _bad(
            f"{p}.name", "a function tool needs a name of 1-64 letters, digits, '_', '.' or '-'"
        )
    fn: dict[str, Any] = {"name": name or own}
    for key in ("description", "parameters", "strict"):
        if t.get(key) is not None:
            fn[key] = t[key]
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise _bad(f"{p}.parameters", "the parameters are a JSON Schema object")
    return {"type": "function", "function": fn}


# What a custom tool's grammar asks of its input, told to the model in the tool's description.
_GRAMMARS = {"lark": "follow this Lark grammar", "regex": "match this regular expression"}


def _custom(t: dict[str, Any], p: str) -> dict[str, Any]:
    """A custom (free-form input) tool as a chat function tool with one required string
    parameter, ``input``. A grammar format is told to the model in the description, with its
    definition: the engine is not constrained by it (its calls are not checked either)."""
    name = t.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(
            f"{p}.name", "a custom tool needs a name of 1-64 letters, digits, '_', '.' or '-'"
        )
    about = t.get("description")
    if about is not None and not isinstance(about, str):
        raise _bad(f"{p}.description", "a custom tool's description is a string")
    fmt = t.get("format")
    if fmt is None:
        fmt = {"type": "text"}
    if not isinstance(fmt, dict):
        raise _bad(f"{p}.format", "a custom tool's format is an object")
    said = [about] if about else []
    if fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if syntax not in _GRAMMARS:
            raise _bad(f"{p}.format.syntax", "a grammar's syntax must be 'lark' or 'regex'")
        if not isinstance(definition, str):
            raise _bad(f"{p}.format.definition", "a grammar needs its definition (a string)")
        said.append(f"The input must {_GRAMMARS[syntax]}:\n```\n{definition}\n```")
    elif fmt.get("type") != "text":
        raise _bad(f"{p}.format.type", "a custom tool's format must be 'text' or 'grammar'")
    text = {"type": "string", "description": "The tool's input: free-form text, not JSON."}
    fn: dict[str, Any] = {
        "name": name,
        "parameters": {
            "type": "object",
            "properties": {"input": text},
            "required": ["input"],
            "additionalProperties": False,
        },
    }
    if said:
        fn["description"] = "\n\n".join(said)
    return {"type": "function", "function": fn}


def _not_served(kind: Any, p: str) -> E.InvalidRequest:
    what = "the built-in tool" if kind in BUILT_IN_TOOLS else "the tool type"
    return _bad(
        f"{p}.type",
        f"{what} {kind!r} is not served by tokenbus: only function tools, custom tools and "
        "namespaces of them are (run the tool yourself and send its result as a "
        "function_call_output)",
    )


def _namespace(
    t: dict[str, Any], p: str, names: ToolNames, taken: set[str]
) -> list[dict[str, Any]]:
    """A ``namespace`` tool's function and custom tools as chat tools (see
    :class:`ToolNames`), the namespace's description put before each one's."""
    ns = t.get("name")
    if not isinstance(ns, str) or not ns:
        raise _bad(f"{p}.name", "a namespace tool needs a name (a non-empty string)")
    about = t.get("description")
    if about is not None and not isinstance(about, str):
        raise _bad(f"{p}.description", "a namespace's description is a string")
    inner = t.get("tools")
    if not isinstance(inner, list) or not inner:
        raise _bad(f"{p}.tools", "a namespace tool needs a list of at least one tool")
    out: list[dict[str, Any]] = []
    for j, f in enumerate(inner):
        q = f"{p}.tools.{j}"
        if not isinstance(f, dict):
            raise _bad(q, "a tool must be an object")
        if f.get("type") not in ("function", "custom"):
            raise _bad(
                f"{q}.type",
                f"the tool type {f.get('type')!r} is not served by tokenbus: only function "
                "tools and custom tools are, in a namespace too",
            )
        tool = _function(f, q) if f["type"] == "function" else _custom(f, q)
        fn = tool["function"]
        if (ns, fn["name"]) in names.to_engine:
            raise _bad(f"{q}.name", f"the namespace {ns!r} has {fn['name']!r} twice")
        fn["name"] = names.add(ns, fn["name"], taken)
        if f["type"] == "custom":
            names.custom.add(fn["name"])
        if about:
            fn["description"] = (
                f"{about}\n\n{fn['description']}" if fn.get("description") else about
            )
        out.append(tool)
    return out


def _tools(tools: list[Any], names: ToolNames) -> list[dict[str, Any]]:
    """The request's tools in chat's shape; namespaced ones flattened into ``names``, custom
    ones named in ``names.custom``; hosted web search left out (:data:`WEB_SEARCH_TOOLS`)."""
    out: list[dict[str, Any]] = []
    spaces: list[tuple[int, dict[str, Any]]] = []
    customs: list[dict[str, Any]] = []  # their chat functions
    functions: set[str] = set()
    for i, t in enumerate(tools):
        p = f"tools.{i}"
        if not isinstance(t, dict):
            raise _bad(p, "a tool must be an object")
        kind = t.get("type")
        if kind == "function":
            out.append(_function(t, p))
            functions.add(out[-1]["function"]["name"])
        elif kind == "custom":
            out.append(_custom(t, p))
            customs.append(out[-1]["function"])
        elif kind == "namespace":
            spaces.append((i, t))
            out.append(t)  # its place, filled below
        elif kind not in WEB_SEARCH_TOOLS:
            raise _not_served(kind, p)
    # Plain names first, so a namespaced tool never takes the name of a plain one.
    taken = {t["function"]["name"] for t in out if "function" in t}
    for fn in customs:
        # The engine calls a tool by its name alone: a custom tool whose name a function tool
        # has too is renamed, as a namespaced one is (under no namespace: ""), so that its
        # calls come back as the custom tool's.
        if fn["name"] in functions:
            own = fn["name"]
            fn["name"] = names.to_engine.get(("", own)) or names.add("", own, taken)
        names.custom.add(fn["name"])
    for i, t in spaces:
        at = next(k for k, x in enumerate(out) if x is t)
        out[at : at + 1] = _namespace(t, f"tools.{i}", names, taken)
    return out


def _chosen(entry: dict[str, Any], names: set[str], table: ToolNames) -> str | None:
    """The chat name of the function or custom tool (``entry["type"]``) a choice names
    (``name``, with ``namespace`` for a namespaced one; a name alone that only one namespace
    has names that one), or None."""
    name, ns = entry.get("name"), entry.get("namespace")
    if not isinstance(name, str):
        return None
    custom = entry.get("type") == "custom"
    kinds = {f for f in names if (f in table.custom) == custom}  # the tools of that type
    if isinstance(ns, str):
        flat = table.to_engine.get((ns, name))
        return flat if flat in kinds else None
    if name in names and name not in table.to_client and name in kinds:
        return name
    found = [f for (_, inner), f in table.to_engine.items() if inner == name and f in kinds]
    return found[0] if len(found) == 1 else None


def _tool_choice(
    choice: str | dict[str, Any], tools: list[dict[str, Any]], table: ToolNames
) -> tuple[str | dict[str, Any], list[dict[str, Any]]]:
    """(chat tool_choice, the tools to send)."""
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", "must be 'none', 'auto', 'required' or an object")
        if choice == "required" and not tools:
            raise _bad("tool_choice", "'required' needs tools")
        return choice, tools
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = _chosen(choice, names, table)
        if name is None:
            what = "" if kind == "function" else " as a custom tool"
            raise _bad(
                "tool_choice.name", f"names {choice.get('name')!r}, which is not in tools{what}"
            )
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise _bad("tool_choice.mode", "must be 'auto' or 'required'")
        allowed = choice.get("tools")
        if not isinstance(allowed, list):
            raise _bad("tool_choice.tools", "the allowed tools are a list")
        # The model picks among the request's tools that are allowed: an entry that names
        # none of them (another type, another name) allows nothing more.
        keep = {
            _chosen(a, names, table)
            for a in allowed
            if isinstance(a, dict) and a.get("type") in ("function", "custom")
        }
        kept = [t for t in tools if t["function"]["name"] in keep]
        if not kept:
            if mode == "required":
                raise _bad(
                    "tool_choice.tools",
                    "'required' allows none of the function or custom tools in tools",
                )
            return "none", []
        return mode, kept
    raise _bad(
        "tool_choice.type",
        f"the tool choice {kind!r} is not served: only function tools are, and custom tools",
    )


def _response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        name = fmt.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(
                "text.format.name",
                "a json_schema format needs a name of 1-64 letters, digits, '_', '.' or '-'",
            )
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("text.format.schema", "a json_schema format needs a schema object")
        js: dict[str, Any] = {"name": name, "schema": schema}
        for key in ("strict", "description"):
            if fmt.get(key) is not None:
                js[key] = fmt[key]
        return {"type": "json_schema", "json_schema": js}
    raise _bad("text.format.type", "must be 'text', 'json_object' or 'json_schema'")


def translate(
    req: ResponsesRequest,
    body: dict[str, Any],
    previous: list[dict[str, Any]] | None = None,
    *,
    response_id: str | None = None,
) -> Turn:
    """The chat request for a Responses request; ``previous``: the chat messages of the
    conversation so far (from ``previous_response_id``'s stored response)."""
    names = ToolNames()
    tools = _tools(req.tools, names) if req.tools else []
    new, items = (
        ([], []) if req.input is None else to_messages(req.input, before=previous, names=names)
    )
    history = [*(previous or []), *new]
    messages = list(history)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise _bad("input", "the conversation is empty: send at least one input item")
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in OWNED}
    chat["model"] = req.model
    chat["messages"] = messages
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.temperature is not None:
        chat["temperature"] = req.temperature
    if req.top_p is not None:
        chat["top_p"] = req.top_p
    choice: str | dict[str, Any] = "auto"
    if req.tool_choice is not None:
        choice, tools = _tool_choice(req.tool_choice, tools, names)
        chat["tool_choice"] = choice
    if tools:
        chat["tools"] = tools
    if req.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    text = req.text or {}
    fmt = _response_format(text)
    if fmt is not None:
        chat["response_format"] = fmt
    if text.get("verbosity") is not None:
        chat["verbosity"] = text["verbosity"]
    reasoning = req.reasoning or {}
    effort = reasoning.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise _bad("reasoning.effort", "must be a string (minimal, low, medium, high...)")
        chat["reasoning_effort"] = effort
    if LOGPROBS_INCLUDE in (req.include or ()) or req.top_logprobs:
        chat["logprobs"] = True
        if req.top_logprobs:
            chat["top_logprobs"] = req.top_logprobs
    echo = {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": req.model,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": effort, "summary": reasoning.get("summary")},
        "store": req.stored,
        "temperature": req.temperature,
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": list(req.tools or []),
        "top_logprobs": req.top_logprobs,
        "top_p": req.top_p,
        "truncation": req.truncation or "disabled",
        **({"user": req.user} if req.user is not None else {}),
        "background": req.background is True,
    }
    turn = Turn(chat, history, items, response_id or new_response_id(), echo, names)
    turn.session = req.prompt_cache_key or None
    turn.encrypted_reasoning = ENCRYPTED_REASONING_INCLUDE in (req.include or ())
    return turn


# -- chunks → output items and events --------------------------------------------------------
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
            "response.reasoning_text.delta",
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
            "response.refusal.delta",
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
                "response.function_call_arguments.delta",
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
            elif item["type"] == "function_call":
                msg.setdefault("tool_calls", []).append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {
                            "name": self._engine_names.get(item["id"], item["name"]),
                            "arguments": item["arguments"],
                        },
                    }
                )
            elif item["type"] == "custom_tool_call":
                args = self._inputs[item["id"]].raw  # as the engine made them
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


# -- the NATS client's stream ----------------------------------------------------------------
class StoredResponses(Protocol):
    """Where a caller's stored responses are (the NATS client asks ingress)."""

    async def get(self, response_id: str) -> dict[str, Any]:
        """The stored record (404 when it is not the caller's)."""
        ...

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Keep a record; False when it could not be kept."""
        ...


class ResponseStream:
    """A Responses answer over NATS: an async iterator of the streaming events (dicts with
    ``type`` and ``sequence_number``, as the HTTP API sends them); ``response`` is the final
    response object once the events end. :meth:`collect` reads it whole.

    ``submit`` sends the translated chat request; ``stored`` reads the conversation of a
    ``previous_response_id`` and keeps the finished response (None: nothing is stored)."""

    def __init__(
        self,
        req: ResponsesRequest,
        body: dict[str, Any],
        submit: Callable[[dict[str, Any]], Stream],
        stored: StoredResponses | None = None,
    ) -> None:
        if req.previous_response_id is not None and stored is None:
            raise _bad(
                "previous_response_id",
                "this client keeps no responses; send the whole conversation as input",
            )
        self.req = req
        self.body = body
        # Translated now, so that a bad field is refused at the call, before any event.
        self.turn = translate(req, body)
        if stored is None:
            self.turn.echo["store"] = False
        self.stream: Stream | None = None
        self.builder = ResponseBuilder(self.turn, events=True)
        self.response: dict[str, Any] | None = None
        self._submit = submit
        self._stored = stored
        self._gen = self._events()

    @property
    def id(self) -> str:
        """The response's id."""
        return self.turn.response_id

    def __aiter__(self) -> AsyncGenerator[dict[str, Any], None]:
        return self._gen

    async def _start(self) -> Stream:
        req, stored = self.req, self._stored
        if req.previous_response_id is not None and stored is not None:
            rec = await stored.get(req.previous_response_id)
            self.turn = translate(
                req, self.body, list(rec.get("messages") or []), response_id=self.turn.response_id
            )
            self.builder = ResponseBuilder(self.turn, events=True)
        self.stream = self._submit(self.turn.chat)
        return self.stream

    async def _events(self) -> AsyncGenerator[dict[str, Any], None]:
        stream = await self._start()
        b = self.builder
        try:
            for ev in b.opening():
                yield ev
            try:
                async for c in stream:
                    for ev in b.add(c):
                        yield ev
            except E.TokenbusError as exc:
                self.response, events = b.fail(exc)
                await self._keep(self.response)  # a failed response is kept too
                for ev in events:
                    yield ev
                return
            resp, events = b.finish(stream.finish_reason, stream.usage, stream.service_tier)
            await self._keep(resp)
            self.response = resp
            for ev in events:
                yield ev
        finally:
            await stream.aclose()

    async def _keep(self, resp: dict[str, Any]) -> None:
        """Store the response when asked to; one that cannot be kept says ``store: false``."""
        if not self.turn.echo.get("store") or self._stored is None:
            return
        rec = record(self.turn, self.builder, resp, "")  # the owner is the key's: ingress says
        try:
            kept = await self._stored.put(self.id, rec)
        except E.TokenbusError:
            kept = False
        if not kept:
            resp["store"] = False

    async def collect(self) -> dict[str, Any]:
        """The whole response object (the events read and dropped)."""
        async for _ in self:
            pass
        assert self.response is not None
        return self.response

    async def aclose(self) -> None:
        """Stop the request."""
        await self._gen.aclose()
        if self.stream is not None:
            await self.stream.aclose()

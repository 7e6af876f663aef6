"""A Responses request translated onto the chat path (:func:`translate`).

``instructions`` become a system message; the ``input`` items chat messages
(:func:`to_messages`: ``function_call`` and ``custom_tool_call`` items an assistant's
``tool_calls``, their outputs tool messages, ``reasoning`` items the next assistant turn's
``reasoning_content``); function tools and ``tool_choice`` chat's shape (the function tools
of a ``namespace`` tool flattened, their calls given back under their namespace:
:class:`ToolNames`; a ``custom`` tool a function with one string parameter, ``input``;
hosted web search left out); ``text.format`` the ``response_format``;
``max_output_tokens`` the ``max_completion_tokens``; ``reasoning.effort`` the
``reasoning_effort``; every other field is carried as the chat path carries it. The result
is a :class:`Turn`: the chat body and what is stored of the request.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from bus_schemas import errors as E
from bus_schemas.side_outputs import REASONING, REFUSAL
from dialects.responses.request import (
    BUILT_IN_TOOLS,
    ENCRYPTED_REASONING_INCLUDE,
    LOGPROBS_INCLUDE,
    OWNED,
    WEB_SEARCH_TOOLS,
    ResponsesRequest,
    _bad,
    new_response_id,
)


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
            raise _bad(
                f"{path}.image_url",
                "an input_image needs an image_url (a URL or a data: URL) or the file_id of "
                "an image in the key's files (/v1/files)",
            )
        image: dict[str, Any] = {"url": url}
        if part.get("detail") is not None:
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        data, url = part.get("file_data"), part.get("file_url")
        file: dict[str, Any]
        if isinstance(data, str) and data:
            file = {"file_data": data}
        elif isinstance(url, str) and url:
            file = {"file_url": url}  # carried: the engine fetches it (or refuses it)
        else:
            raise _bad(
                f"{path}.file_data",
                "an input_file needs file_data, a file_url, or the file_id of a file in the "
                "key's files (/v1/files)",
            )
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


_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
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
            msg[REASONING.chat] = "".join(self.reasoning)
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
                        msg[REFUSAL.chat] = refusal
            msgs.add(msg)
            stored.append(_stored_message(item, role))
        elif kind in ("function_call", "custom_tool_call"):  # kind may be a list
            call, item_stored = _call_item(item, p, kind, names or ToolNames())
            msgs.call(call)
            stored.append(item_stored)
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


class _CallKind(NamedTuple):
    """How one kind of call item differs from the other (:data:`_CALL_ITEMS`)."""

    given: str  # the field with what the call was given
    names: str  # what its name names
    given_is: str  # what that field must be ("are a JSON string")
    prefix: str  # the stored item's id prefix


_CALL_ITEMS = {
    "function_call": _CallKind("arguments", "the function's name", "are a JSON string", "fc"),
    "custom_tool_call": _CallKind("input", "the tool's name", "is a string", "ctc"),
}


def _call_item(
    item: dict[str, Any], p: str, kind: str, names: ToolNames
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the chat tool call, the stored item) of a ``function_call`` or ``custom_tool_call``
    input item (``kind``): a function call's arguments are carried as they are; a custom
    tool call's input as the arguments ``{"input": ...}``, as the engine made them
    (:func:`_custom`). A call with a ``namespace`` is made under its chat name; a custom
    tool call without one under the name its tool was renamed to, if it was."""
    how = _CALL_ITEMS[kind]
    call_id, name, given = item.get("call_id"), item.get("name"), item.get(how.given)
    if not isinstance(call_id, str):
        raise _bad(f"{p}.call_id", f"a {kind} needs a call_id")
    if not isinstance(name, str):
        raise _bad(f"{p}.name", f"a {kind} needs {how.names}")
    if not isinstance(given, str):
        raise _bad(f"{p}.{how.given}", f"a {kind}'s {how.given} {how.given_is}")
    namespace = item.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise _bad(f"{p}.namespace", f"a {kind}'s namespace is a string")
    namespace = namespace or None  # "": no namespace (the default one)
    custom = kind == "custom_tool_call"
    if namespace is not None:
        engine_name = names.engine(namespace, name)
    elif custom:
        engine_name = names.to_engine.get(("", name), name)  # renamed when a function has its name
    else:
        engine_name = name
    args = json.dumps({"input": given}, ensure_ascii=False) if custom else given
    call = {"id": call_id, "type": "function", "function": {"name": engine_name, "arguments": args}}
    stored = {
        "id": item.get("id") or _item_id(how.prefix),
        "type": kind,
        "call_id": call_id,
        "name": name,
        **({"namespace": namespace} if namespace is not None else {}),
        how.given: given,
        "status": "completed",
    }
    return call, stored


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

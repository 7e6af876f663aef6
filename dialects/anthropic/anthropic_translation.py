"""A Messages request translated onto the chat path (:func:`translate`).

``system`` becomes a system message; each message's content blocks chat content (``text``,
``image`` as an ``image_url`` part, ``document`` as a ``file`` or text part), an assistant's
``tool_use`` blocks its ``tool_calls`` and its ``thinking`` its ``reasoning_content``, a
user's ``tool_result`` blocks ``tool`` messages (:func:`to_messages`); ``tools``
(``input_schema``) function tools, ``tool_choice`` chat's (``any`` is ``required``);
``stop_sequences`` ``stop``; ``metadata.user_id`` ``user``; ``thinking`` the chat template's
switch. Fields it does not know are carried to the engine as the chat path carries them.
:func:`count_request` is the chat request that counts a ``count_tokens`` request's tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dialects.anthropic.anthropic_request import OWNED, MessagesRequest, _bad

# Anthropic's ``service_tier`` as a class asked for: ``auto`` is the key's default
# (docs/flow.md), ``standard_only`` never priority.
_ASKED_TIERS = {"auto": None, "standard_only": "default"}
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


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

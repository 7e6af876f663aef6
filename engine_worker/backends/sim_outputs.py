"""The simulator's outputs beside plain text: JSON values for schemas, tool calls, logprobs
and embeddings. Every one is a pure function of the request, so tests can assert them exactly.

* :func:`instance` builds a JSON value valid against a JSON Schema (structured output, tool
  arguments).
* :func:`expected_tool_call` tells which tool call a chat request gets, if any.
* :func:`expected_embedding` is the vector the simulator gives an embeddings input.
* :func:`chat_logprobs` / :func:`completion_logprobs` are the logprobs objects of a run of
  output tokens.

Structured text is cut into tokens of four characters (:func:`json_tokens`), the sim
tokenizer's size (``count_tokens``), and streamed one token per decode step like text.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Sequence
from typing import Any

from bus_schemas import errors as E
from engine_worker.backends.base import GenerationRequest

# The tokens offered beside the chosen one in ``top_logprobs`` (distinct, so a completions
# ``{token: logprob}`` map keeps them all).
ALTERNATIVES = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "for",
    "on",
    "as",
    "at",
    "by",
    "we",
    "an",
    "or",
    "be",
    "this",
    "that",
    "with",
    "from",
    "not",
    "all",
    "can",
    "one",
)
MAX_TOP_LOGPROBS = 20
MAX_EMBEDDING_DIM = 65536

# Objects nested deeper than this get only their required properties, arrays only their
# ``minItems``, optional values null: recursive schemas end.
_FULL_DEPTH = 4
_MAX_DEPTH = 64
_MAX_REF_HOPS = 32


# -- JSON values for schemas --------------------------------------------------------------


class SchemaError(ValueError):
    """The schema cannot be instantiated (an unresolvable ``$ref``, endless recursion)."""


_FORMATS = {
    "date": "2024-01-{day:02d}",
    "date-time": "2024-01-{day:02d}T10:30:00Z",
    "time": "10:30:00Z",
    "duration": "P{day}D",
    "email": "user{n}@example.com",
    "idn-email": "user{n}@example.com",
    "uri": "https://example.com/{n}",
    "url": "https://example.com/{n}",
    "iri": "https://example.com/{n}",
    "uri-reference": "https://example.com/{n}",
    "iri-reference": "https://example.com/{n}",
    "hostname": "host{n}.example.com",
    "idn-hostname": "host{n}.example.com",
    "ipv4": "192.0.2.{n1}",
    "ipv6": "2001:db8::{n1}",
    "uuid": "123e4567-e89b-42d3-a456-4266141740{n:02d}",
    "json-pointer": "/items/{n}",
    "path": "/srv/data/file{n}",
}

_WORDS = (
    "alpha",
    "bravo",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "grove",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lumen",
    "meadow",
    "nimbus",
    "orchid",
    "pebble",
)


def instance(schema: Any) -> Any:
    """A JSON value valid against the JSON Schema ``schema``, the same every time.

    Supported: ``type`` (one or a list), ``const``, ``enum``, objects (``properties``, all of
    them filled near the top, ``required``, ``additionalProperties``, ``minProperties``),
    arrays (``items``, ``prefixItems``, ``minItems``/``maxItems``), strings
    (``minLength``/``maxLength``, the common ``format`` values), integers and numbers
    (``minimum``/``maximum``, exclusive bounds, ``multipleOf``), booleans, null, ``$ref``
    into the schema (``#/$defs/...``, ``#/definitions/...``, any JSON pointer), ``anyOf``/
    ``oneOf`` (the first non-null option), ``allOf`` (merged). ``pattern`` is not honoured.
    Raises :class:`SchemaError` for a ``$ref`` that does not resolve, a schema whose values
    are malformed (``minItems: "x"``), or one that asks for more than :data:`MAX_NODES`
    values (``minItems: 1000000000``): the sim answers such a request with a 400 instead of
    working on it without bound.
    """
    try:
        return _Builder(schema).value(schema, "$", 0, 0, 0)
    except SchemaError:
        raise
    except (ValueError, TypeError, OverflowError, KeyError, AttributeError, RecursionError) as e:
        raise SchemaError(f"the schema cannot be instantiated: {type(e).__name__}: {e}") from None


# The most values (objects, arrays, scalars) one schema instance may have.
MAX_NODES = 20_000


class _Builder:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.nodes = 0

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise SchemaError(f"only local $ref are supported, not {ref!r}")
        node = self.root
        for raw in ref[1:].split("/")[1:]:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaError(f"$ref {ref!r} does not resolve")
        return node

    def flatten(self, s: dict[str, Any], hops: int) -> dict[str, Any]:
        """``s`` with its ``$ref`` and ``allOf`` merged in."""
        if hops > _MAX_REF_HOPS:
            raise SchemaError("$ref chain too long")
        if "$ref" in s:
            target = self.resolve(str(s["$ref"]))
            rest = {k: v for k, v in s.items() if k != "$ref"}
            if not isinstance(target, dict):
                return rest if target is True else {**rest, "not": {}}
            s = _merge(self.flatten(target, hops + 1), rest)
        if "allOf" in s:
            merged = {k: v for k, v in s.items() if k != "allOf"}
            for sub in s["allOf"] or ():
                if isinstance(sub, dict):
                    merged = _merge(merged, self.flatten(sub, hops + 1))
            s = merged
        return s

    def value(self, schema: Any, path: str, depth: int, hops: int, variant: int) -> Any:
        if depth > _MAX_DEPTH:
            raise SchemaError("schema recursion too deep")
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise SchemaError(f"the schema asks for more than {MAX_NODES} values")
        if not isinstance(schema, dict):
            return None  # true (anything) or false (nothing fits)
        s = self.flatten(schema, hops)
        if "const" in s:
            return s["const"]
        enum = s.get("enum")
        if isinstance(enum, list) and enum:
            return enum[variant % len(enum)]
        options = s.get("anyOf") or s.get("oneOf")
        if isinstance(options, list) and options:
            return self.option(options, path, depth, hops, variant)
        kind = _kind(s)
        if kind == "object":
            return self.object(s, path, depth, variant)
        if kind == "array":
            return self.array(s, path, depth)
        if kind == "string":
            return _string(s, path, variant)
        if kind == "integer":
            return _integer(s, variant)
        if kind == "number":
            return _number(s, variant)
        if kind == "boolean":
            return variant % 2 == 0
        return None

    def option(self, options: list[Any], path: str, depth: int, hops: int, variant: int) -> Any:
        flat = [self.flatten(o, hops + 1) if isinstance(o, dict) else o for o in options]
        nullable = [_is_null(o) for o in flat]
        if any(nullable) and (depth >= _FULL_DEPTH or all(nullable)):
            return None
        for o, null in zip(flat, nullable, strict=True):
            if not null:
                return self.value(o, path, depth, hops + 1, variant)
        return None

    def object(self, s: dict[str, Any], path: str, depth: int, variant: int) -> dict[str, Any]:
        props = s.get("properties")
        props = props if isinstance(props, dict) else {}
        required = [k for k in s.get("required") or () if isinstance(k, str)]
        full = depth < _FULL_DEPTH
        extra = s.get("additionalProperties", True)
        out: dict[str, Any] = {}
        for key, sub in props.items():
            if full or key in required:
                out[key] = self.value(sub, f"{path}.{key}", depth + 1, 0, variant)
        for key in required:
            if key not in out:
                sub = extra if isinstance(extra, dict) else {}
                out[key] = self.value(sub, f"{path}.{key}", depth + 1, 0, variant)
        want = int(s.get("minProperties") or 0)
        if full and not props and isinstance(extra, dict):
            want = max(want, 1)
        n = 0
        while len(out) < want and extra is not False:
            n += 1
            key = "key" if n == 1 else f"key{n}"
            if key not in out:
                sub = extra if isinstance(extra, dict) else {}
                out[key] = self.value(sub, f"{path}.{key}", depth + 1, 0, n - 1)
        return out

    def array(self, s: dict[str, Any], path: str, depth: int) -> list[Any]:
        prefix = s.get("prefixItems")
        items = s.get("items", {})
        if isinstance(items, list):  # the old tuple form
            prefix, items = items, s.get("additionalItems", {})
        out: list[Any] = []
        if isinstance(prefix, list):
            out = [self.value(p, f"{path}[{i}]", depth + 1, 0, i) for i, p in enumerate(prefix)]
        want = int(s.get("minItems") or 0)
        if depth < _FULL_DEPTH and not out:
            want = max(want, 1)
        cap = s.get("maxItems")
        if isinstance(cap, int):
            want = min(want, cap)
        if items is False:
            return out
        while len(out) < want:
            i = len(out)
            out.append(self.value(items, f"{path}[{i}]", depth + 1, 0, i))
        return out


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if k == "properties" and isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        elif k == "required" and isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = list(dict.fromkeys([*out[k], *v]))
        elif k == "type" and k in out and out[k] != v:
            mine = out[k] if isinstance(out[k], list) else [out[k]]
            theirs = v if isinstance(v, list) else [v]
            both = [
                "integer" if {t, u} == {"integer", "number"} else t
                for t in mine
                for u in theirs
                if t == u or {t, u} == {"integer", "number"}
            ]
            out[k] = both[0] if len(both) == 1 else both
        elif k not in out:
            out[k] = v
    return out


def _is_null(s: Any) -> bool:
    if not isinstance(s, dict):
        return False
    t = s.get("type")
    return t == "null" or t == ["null"] or ("const" in s and s["const"] is None)


def _kind(s: dict[str, Any]) -> str | None:
    t = s.get("type")
    if isinstance(t, list):
        real = [x for x in t if x != "null"]
        return str(real[0]) if real else ("null" if t else None)
    if isinstance(t, str):
        return t
    if "properties" in s or "additionalProperties" in s or "required" in s:
        return "object"
    if "items" in s or "prefixItems" in s:
        return "array"
    if {"minLength", "maxLength", "format", "pattern"} & s.keys():
        return "string"
    if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"} & s.keys():
        return "number"
    return None


def _string(s: dict[str, Any], path: str, variant: int) -> str:
    fmt = _FORMATS.get(str(s.get("format", "")))
    if fmt is not None:
        text = fmt.format(day=15 + variant % 14, n=variant, n1=variant + 1)
    else:
        h = zlib.crc32(path.encode()) + variant
        text = f"{_WORDS[h % len(_WORDS)]} {_WORDS[(h // len(_WORDS) + variant) % len(_WORDS)]}"
        if variant:
            text += f" {variant}"
    lo, hi = s.get("minLength"), s.get("maxLength")
    if isinstance(lo, int) and len(text) < lo:
        text += "x" * (lo - len(text))
    if isinstance(hi, int) and len(text) > hi:
        text = text[:hi]
    return text


def _bounds(s: dict[str, Any]) -> tuple[float | None, float | None, float | None, float | None]:
    """(minimum, exclusive minimum, maximum, exclusive maximum); draft 4's boolean
    exclusive flags turn the plain bound exclusive."""

    def num(v: Any) -> float | None:
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    lo, hi = num(s.get("minimum")), num(s.get("maximum"))
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    lo_ex = lo if xlo is True else num(xlo)
    hi_ex = hi if xhi is True else num(xhi)
    return (None if xlo is True else lo), lo_ex, (None if xhi is True else hi), hi_ex


def _integer(s: dict[str, Any], variant: int) -> int:
    lo_in, lo_ex, hi_in, hi_ex = _bounds(s)
    lows = [math.ceil(lo_in)] if lo_in is not None else []
    lows += [math.floor(lo_ex) + 1] if lo_ex is not None else []
    highs = [math.floor(hi_in)] if hi_in is not None else []
    highs += [math.ceil(hi_ex) - 1] if hi_ex is not None else []
    lo, hi = (max(lows) if lows else None), (min(highs) if highs else None)
    v = (lo if lo is not None else 1) + variant
    if hi is not None and v > hi:
        v = max(hi - variant, lo) if lo is not None else hi - variant
    m = s.get("multipleOf")
    if isinstance(m, int) and not isinstance(m, bool) and m > 0:
        up = math.ceil(v / m) * m
        v = up if hi is None or up <= hi else math.floor(v / m) * m
    return v


def _number(s: dict[str, Any], variant: int) -> float | int:
    lo_in, lo_ex, hi_in, hi_ex = _bounds(s)
    v = 1.5 + variant
    if lo_in is not None and v < lo_in:
        v = lo_in
    if lo_ex is not None and v <= lo_ex:
        v = lo_ex + 1
    if hi_in is not None and v > hi_in:
        v = hi_in
    if hi_ex is not None and v >= hi_ex:
        v = hi_ex - 1
    low = max((b for b in (lo_in, lo_ex) if b is not None), default=None)
    if low is not None and (v < low or (lo_ex is not None and v <= lo_ex)):
        high = min(b for b in (hi_in, hi_ex) if b is not None)
        v = (low + high) / 2
    m = s.get("multipleOf")
    if isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0:
        k = math.ceil(v / m) if low is None else math.ceil(low / m)
        if lo_ex is not None and k * m <= lo_ex:
            k += 1
        for j in range(k, k + 64):  # one whose quotient comes out whole in floats
            cand = j * m
            if (cand / m).is_integer():
                v = cand
                break
    return v


# -- tool calls and structured output -----------------------------------------------------


def json_tokens(text: str) -> list[str]:
    """``text`` cut into the simulator's tokens of four characters."""
    return [text[i : i + 4] for i in range(0, len(text), 4)] or [""]


def _function_tools(extra: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    tools = extra.get("tools")
    for t in tools if isinstance(tools, list) else ():  # a list unless the sender is broken
        if isinstance(t, dict) and t.get("type") == "function":
            fn = t.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                out.append(fn)
    return out


def chosen_tool(req: GenerationRequest) -> dict[str, Any] | None:
    """The function (the tool's ``function`` object) a chat request calls, or None.

    A call happens when the request has function tools, ``tool_choice`` is not ``none``, and
    the choice is ``required`` or names a function, or the last message is not a ``tool``
    message (a turn that carries tool results gets text). The named function is called,
    else the first one. A named function that is not among the tools is an InvalidRequest.
    """
    if req.kind != "chat" or not req.extra:
        return None
    tools = _function_tools(req.extra)
    if not tools:
        return None
    choice = req.extra.get("tool_choice")
    if choice == "none":
        return None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn_choice = choice.get("function")
        name = fn_choice.get("name") if isinstance(fn_choice, dict) else None
        for fn in tools:
            if fn["name"] == name:
                return fn
        raise E.InvalidRequest(f"tool_choice names {name!r}, not a tool", param="tool_choice")
    if choice != "required" and req.messages and req.messages[-1].get("role") == "tool":
        return None
    return tools[0]


def tool_call_id(prompt: str, name: str, seed: int | None = None) -> str:
    """The deterministic id of the call to ``name`` for ``prompt``."""
    return "call_" + hashlib.sha256(f"{seed}|{name}|{prompt}".encode()).hexdigest()[:24]


def expected_tool_call(req: GenerationRequest) -> tuple[str, str, str] | None:
    """(id, name, arguments) of the tool call the simulator makes for ``req``, or None when
    it answers with text. The arguments are ``json.dumps`` of :func:`instance` of the
    function's ``parameters``; they stream in :func:`json_tokens` (finish ``tool_calls``,
    or ``length`` when ``max_tokens`` runs out first)."""
    fn = chosen_tool(req)
    if fn is None:
        return None
    name = str(fn["name"])
    params = fn.get("parameters")
    if not isinstance(params, dict) or not params:
        params = {"type": "object", "properties": {}}
    try:
        args = json.dumps(instance(params))
    except SchemaError as e:
        raise E.InvalidRequest(f"tool {name!r}: {e}", param="tools") from None
    return tool_call_id(req.prompt_text(), name, req.seed), name, args


def response_schema(extra: dict[str, Any]) -> tuple[str, Any] | None:
    """What ``response_format`` asks for: ``("json_schema", schema)``, ``("json_object",
    None)``, or None for text."""
    rf = extra.get("response_format")
    if not isinstance(rf, dict):
        return None
    kind = rf.get("type")
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        return "json_schema", schema if isinstance(schema, (dict, bool)) else {"type": "object"}
    if kind == "json_object":
        return "json_object", None
    return None


def schema_text(schema: Any) -> str:
    """The structured output for a ``json_schema`` response format."""
    try:
        return json.dumps(instance(schema))
    except SchemaError as e:
        raise E.InvalidRequest(f"response_format: {e}", param="response_format") from None


# -- logprobs ------------------------------------------------------------------------------


def logprob_mode(kind: str, extra: dict[str, Any]) -> tuple[str, int] | None:
    """``("chat", top_logprobs)`` for a chat request with ``logprobs: true``,
    ``("completions", k)`` for a text completion with ``logprobs: k``, else None."""
    lp = extra.get("logprobs")
    if kind == "chat":
        if lp is not True:
            return None
        top = extra.get("top_logprobs")
        k = top if isinstance(top, int) and not isinstance(top, bool) else 0
        return "chat", max(0, min(k, MAX_TOP_LOGPROBS))
    if isinstance(lp, int) and not isinstance(lp, bool) and lp >= 0:
        return "completions", min(lp, MAX_TOP_LOGPROBS)
    return None


def token_logprob(h: int, i: int) -> float:
    """The logprob of output token ``i`` of the output whose hash is ``h``: in (-1.5, 0]."""
    x = zlib.crc32(f"{h}:{i}".encode())
    return -round((x % 15000) / 10000.0, 4)


def top_alternatives(token: str, h: int, i: int, k: int) -> list[tuple[str, float]]:
    """The ``k`` most likely tokens at position ``i``: the chosen one first, then distinct
    alternatives with lower logprobs."""
    k = min(k, len(ALTERNATIVES))
    if k <= 0:
        return []
    lp = token_logprob(h, i)
    out = [(token, lp)]
    space = " " if token.startswith(" ") else ""
    j = (h + i * 31) % len(ALTERNATIVES)
    drop = 1.0
    while len(out) < k:
        alt = space + ALTERNATIVES[j % len(ALTERNATIVES)]
        j += 1
        if alt == token:
            continue
        out.append((alt, round(lp - drop, 4)))
        drop += 0.5
    return out


def chat_logprobs(tokens: Sequence[str], h: int, first: int, top: int) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``tokens``, output positions ``first``, ``first+1``..."""
    content = []
    for n, t in enumerate(tokens):
        i = first + n
        content.append(
            {
                "token": t,
                "logprob": token_logprob(h, i),
                "bytes": list(t.encode()),
                "top_logprobs": [
                    {"token": a, "logprob": lp, "bytes": list(a.encode())}
                    for a, lp in top_alternatives(t, h, i, top)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    tokens: Sequence[str], h: int, first: int, k: int, offset: int
) -> dict[str, Any]:
    """The text completion ``logprobs`` object of ``tokens`` (positions from ``first``; the
    first token starts at character ``offset`` of the completion)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": list(tokens),
        "token_logprobs": [token_logprob(h, first + n) for n in range(len(tokens))],
        "top_logprobs": [dict(top_alternatives(t, h, first + n, k)) for n, t in enumerate(tokens)],
        "text_offset": offsets,
    }


# -- embeddings ----------------------------------------------------------------------------


def _embedding_seed(item: str | Sequence[int]) -> int:
    if isinstance(item, str):
        return zlib.crc32(item.encode())
    return zlib.crc32(("\x00ids:" + ",".join(str(int(t)) for t in item)).encode())


def expected_embedding(item: str | Sequence[int], dims: int) -> list[float]:
    """The unit-length vector of ``dims`` the simulator gives ``item`` (a string or token id
    list). A shorter ``dims`` is the longer vector's start, normalised again."""
    x = _embedding_seed(item)
    mask = (1 << 64) - 1
    vals: list[float] = []
    for _ in range(dims):  # splitmix64
        x = (x + 0x9E3779B97F4A7C15) & mask
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        vals.append((z >> 11) / float(1 << 52) - 1.0)
    norm = math.sqrt(sum(v * v for v in vals))
    if norm == 0.0:
        return [1.0] + [0.0] * (dims - 1)
    return [v / norm for v in vals]

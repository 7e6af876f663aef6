"""A whole answer put together from its chunks (:class:`Assembled`): the text, and each side
output merged as its row of :mod:`bus_schemas.side_outputs` says."""

from __future__ import annotations

from typing import Any, Protocol, cast

from bus_schemas.side_outputs import (
    EMBEDDING,
    LOGPROBS,
    REASONING,
    REFUSAL,
    SIDE_OUTPUTS,
    TOOL_CALLS,
    Merge,
    SideOutput,
)
from services.chunks import Chunk


class _Merger(Protocol):
    def add(self, value: Any) -> None: ...

    def result(self) -> Any: ...


class _Text:
    """Text fragments, joined in order."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[str] = []

    def add(self, value: str) -> None:
        self._parts.append(value)

    def result(self) -> str:
        return "".join(self._parts)


class _Calls:
    """Tool-call deltas merged by index: id, type and name from the first that has them,
    the arguments fragments joined."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, value: list[dict[str, Any]]) -> None:
        for d in value:
            idx = int(d.get("index", 0))
            call = self._calls.get(idx)
            fn = d.get("function") or {}
            if call is None:
                call = self._calls[idx] = {
                    "id": d.get("id") or "",
                    "type": d.get("type") or "function",
                    "function": {"name": fn.get("name") or "", "arguments": ""},
                }
            elif d.get("id"):
                call["id"] = d["id"]
            if fn.get("name") and not call["function"]["name"]:
                call["function"]["name"] = fn["name"]
            call["function"]["arguments"] += fn.get("arguments") or ""

    def result(self) -> list[dict[str, Any]]:
        return [self._calls[k] for k in sorted(self._calls)]


class _Lists:
    """Objects whose lists are extended (logprobs: ``content``, ``tokens``...); a key the
    first object lacked is taken from the first that has it."""

    __slots__ = ("_whole",)

    def __init__(self) -> None:
        self._whole: dict[str, Any] | None = None

    def add(self, value: dict[str, Any]) -> None:
        if self._whole is None:
            self._whole = {k: list(v) if isinstance(v, list) else v for k, v in value.items()}
            return
        for k, v in value.items():
            have = self._whole.get(k)
            if isinstance(v, list) and isinstance(have, list):
                have.extend(v)
            elif have is None:
                self._whole[k] = list(v) if isinstance(v, list) else v

    def result(self) -> dict[str, Any] | None:
        return self._whole


class _ByIndex:
    """Whole values (``{"index", "embedding"}``) kept by index, in index order."""

    __slots__ = ("_by_index",)

    def __init__(self) -> None:
        self._by_index: dict[int, list[float]] = {}

    def add(self, value: dict[str, Any]) -> None:
        self._by_index[int(value.get("index", 0))] = value.get("embedding") or []

    def result(self) -> list[list[float]]:
        return [self._by_index[k] for k in sorted(self._by_index)]


_MERGERS: dict[Merge, type[_Merger]] = {
    "text": _Text,
    "calls": _Calls,
    "lists": _Lists,
    "by_index": _ByIndex,
}


class Assembled:
    """A whole answer put together from its chunks: text, tool calls (deltas merged by
    index), logprobs, refusal, reasoning and embeddings."""

    __slots__ = ("_side", "_text")

    def __init__(self) -> None:
        self._text: list[str] = []
        self._side: dict[str, _Merger] = {}  # by side output's name, once one came

    def add(self, c: Chunk) -> None:
        if c.text:
            self._text.append(c.text)
        for s in SIDE_OUTPUTS:
            value = getattr(c, s.name)
            if value:
                merger = self._side.get(s.name)
                if merger is None:
                    merger = self._side[s.name] = _MERGERS[s.merge]()
                merger.add(value)

    def _result(self, s: SideOutput) -> Any:
        merger = self._side.get(s.name)
        return None if merger is None else merger.result()

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return cast("list[dict[str, Any]] | None", self._result(TOOL_CALLS))

    @property
    def logprobs(self) -> dict[str, Any] | None:
        return cast("dict[str, Any] | None", self._result(LOGPROBS))

    @property
    def refusal(self) -> str | None:
        return cast("str | None", self._result(REFUSAL))

    @property
    def reasoning(self) -> str | None:
        return cast("str | None", self._result(REASONING))

    @property
    def embeddings(self) -> list[list[float]]:
        return cast("list[list[float]]", self._result(EMBEDDING) or [])

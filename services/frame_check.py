"""The shape check of a stream frame a caller reads (:func:`bad_field`): a frame from a
faulty or forged sender ends its attempt instead of failing the reader."""

from __future__ import annotations

from typing import Any

from bus_schemas import frames
from bus_schemas.side_outputs import EMBEDDING, SIDE_OUTPUTS, TOOL_CALLS

# A chunk's output beside its text, by wire key: the type each must have.
_SIDE: dict[str, type] = {s.wire: s.type for s in SIDE_OUTPUTS}


def _has(d: dict[str, Any], key: str, *types: type) -> bool:
    """``d`` holds no ``key``, or holds one of ``types`` under it."""
    return key not in d or isinstance(d[key], types)


def _opt(value: Any, *types: type) -> bool:
    """``value`` is None or of one of ``types``."""
    return value is None or isinstance(value, types)


def _bad_tool_calls(calls: list[Any]) -> bool:
    """Whether a tool-call delta is not an object with an int index and a string name and
    arguments (where it has them)."""
    for call in calls:
        if not isinstance(call, dict) or not _has(call, "index", int):
            return True
        fn = call.get("function")
        if not _opt(fn, dict) or not all(
            _opt((fn or {}).get(k), str) for k in ("name", "arguments")
        ):
            return True
    return False


def bad_field(frame: dict[str, Any]) -> str | None:
    """The first field of a stream frame that is not of its type (None: none is). Only the
    shape of what a caller reads is checked, with ``isinstance`` alone: cheap per chunk."""
    t = frame.get("t")
    if t == frames.CHUNK:
        if not isinstance(frame.get("d"), str):
            return "d"
        if not (_has(frame, "n", int) and _has(frame, "i", int)):
            return "n" if not _has(frame, "n", int) else "i"
        if len(frame) <= 4:  # t, d, n, i: the common chunk
            return None
        bad = next((k for k, typ in _SIDE.items() if not _opt(frame.get(k), typ)), None)
        if bad is not None:
            return bad
        if _bad_tool_calls(frame.get(TOOL_CALLS.wire) or []):
            return TOOL_CALLS.wire
        em = frame.get(EMBEDDING.wire) or {}
        if not (_has(em, "index", int) and _opt(em.get("embedding"), list)):
            return EMBEDDING.wire
    elif t == frames.ACCEPT:
        hb = frame.get("heartbeat_s")
        if not _opt(hb, int, float) or (hb is not None and not 0 < hb < 3600):
            return "heartbeat_s"
        return next(
            (k for k in ("replica", "rl", "adm", "tp", "tier") if not _opt(frame.get(k), str)),
            None,
        )
    elif t == frames.FINAL:
        usage, timings = frame.get("usage") or {}, frame.get("timings") or {}
        if not _opt(frame.get("finish_reason"), str):
            return "finish_reason"
        if not _opt(frame.get("stop_sequence"), str):
            return "stop_sequence"
        if not isinstance(usage, dict) or not all(
            _has(usage, k, int) for k in ("prompt_tokens", "completion_tokens")
        ):
            return "usage"
        if not isinstance(timings, dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in timings.items()
        ):
            return "timings"
    elif t == frames.ERROR:
        err = frame.get("error") or {}
        headers = (err.get("headers") or {}) if isinstance(err, dict) else {}
        if not isinstance(err, dict) or not (
            _has(err, "status", int)
            and _opt(err.get("param"), str)
            and isinstance(headers, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        ):
            return "error"
    elif t == frames.ALIVE and not _has(frame, "e", int):
        return "e"
    return None

"""Stage timestamps carried in the ``Tb-Timings`` header (epoch nanoseconds)."""

from __future__ import annotations

import re
import time
import uuid

from bus_schemas import headers as H

# Epoch nanoseconds have 19 digits; a longer value is no time and no count (nor does it fit
# the 64 bits msgpack carries).
MAX_DIGITS = 19


def number(value: str | None) -> int | None:
    """A header's non-negative integer (a timestamp, a count); None when the value is not
    plain ASCII digits, or too long to be one."""
    if value and len(value) <= MAX_DIGITS and value.isascii() and value.isdigit():
        return int(value)
    return None


def attempt(value: str | None) -> int:
    """Which attempt of a request a ``Tb-Migration`` value names: 0 for the first, and for
    anything that is not a count of at most three digits."""
    return (number(value) or 0) if value and len(value) < 4 else 0


_OUR_ID = re.compile(r"[0-9a-f]{32}")


def new_request_id() -> str:
    """A request id of the gateway's own, unique per admission (``Tb-Request-Id``): what
    slots, holds, tickets and charges are keyed by. Ingress, the bridge and the ratelimit
    stage make them; :func:`our_request_id` knows their shape."""
    return uuid.uuid4().hex


def our_request_id(value: str | None) -> str | None:
    """``value`` when it has the shape of an id :func:`new_request_id` makes, else None.
    Only a migration may name one (the id its caller learnt from the accept frame): whether
    it is really its request's is proved by its admission ticket in the ratelimit stage,
    which gives any attempt it cannot prove an id of its own."""
    return value if value and _OUR_ID.fullmatch(value) else None


def now_ns() -> int:
    return time.time_ns()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def append(hdrs: dict[str, str], stage: str, ts_ns: int | None = None) -> None:
    """Record that ``stage`` saw the request now (or at ``ts_ns``)."""
    mark = f"{stage}={now_ns() if ts_ns is None else ts_ns}"
    prev = hdrs.get(H.TIMINGS)
    hdrs[H.TIMINGS] = f"{prev},{mark}" if prev else mark


def parse(hdrs: dict[str, str] | None) -> dict[str, int]:
    """All marks of a message, with the client's t0 as ``t0``; malformed marks are skipped."""
    out: dict[str, int] = {}
    if not hdrs:
        return out
    t0 = number(hdrs.get(H.T0))
    if t0 is not None:
        out["t0"] = t0
    for part in hdrs.get(H.TIMINGS, "").split(","):
        name, _, val = part.partition("=")
        ts = number(val)
        if name and ts is not None:
            out[name] = ts
    return out


def expired(hdrs: dict[str, str] | None) -> bool:
    """True when the message carries a deadline that has passed."""
    if not hdrs:
        return False
    d = number(hdrs.get(H.DEADLINE))
    return d is not None and d <= now_ms()


def deadline_ms(hdrs: dict[str, str] | None) -> int | None:
    if not hdrs:
        return None
    return number(hdrs.get(H.DEADLINE))


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def traceparent(value: str | None) -> str | None:
    """A W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``), normalised, or None
    when it is not one."""
    tp = (value or "").strip().lower()
    return tp if _TRACEPARENT.fullmatch(tp) else None


def trace_id(hdrs: dict[str, str] | None) -> str | None:
    """The trace id of the message's traceparent, if it carries a valid one."""
    tp = traceparent((hdrs or {}).get(H.TRACEPARENT))
    return tp.split("-")[1] if tp else None

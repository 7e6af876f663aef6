"""Usage reports to the rate limiter that admitted a request (``tb.v1.usage.<instance>``).

The ratelimit stage reserves tokens and, for keys with a concurrency limit, a slot when it
admits a request, and records in the ``Tb-Ratelimit`` header (window, tokens reserved,
flags, its instance) where the report must go. The worker reports what the engine really
used when the request ends. A request that ends before any worker took it (the filter
blocked it, no replica could serve it, the engine refused it at the start) is reported by
whoever ended it, with nothing used, so the slot and the reservation go back at once
instead of at the request's deadline.

A request that held spend (``Tb-Spend``) is reported on ``tb.v1.usage.<instance>.spend``
with what it held: the stream ``TOKENBUS_SPEND_REPORTS`` keeps that report until a limiter
has settled it, so a limiter that dies (or is cut off) with requests in flight leaves
their charges to the others instead of losing them.
"""

from __future__ import annotations

import contextlib

from nats.aio.client import Client as NATS

from bus_schemas import codec, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H


def report_body(
    hdrs: dict[str, str],
    rid: str,
    *,
    max_tokens: int,
    prompt_tokens: int,
    completion: int,
    cached: int = 0,
    duplicate: str | None = None,
) -> tuple[str, bytes] | None:
    """The subject and body of a usage report; None when the request was not admitted by a
    limiter (no ``Tb-Ratelimit`` header, or a malformed one). ``prompt_tokens`` < 0: not
    known, the admission's estimate is kept. ``duplicate``: the replica of a copy its
    caller cancelled unread (auth.budgets.SpendBook.settle)."""
    try:
        window, reserved, flags, owner = [*hdrs[H.RATELIMIT].split(","), ""][:4]
        if prompt_tokens < 0:
            prompt_tokens = max(0, int(reserved) - max_tokens)
        body = {
            "principal": hdrs.get(H.PRINCIPAL, ""),
            "request_id": rid,
            "window": int(window),
            "reserved": int(reserved),
            "used": prompt_tokens + completion,
            "prompt": prompt_tokens,
            "completion": completion,
            # Prompt tokens read from the engine's cache (priced apart: auth.budgets).
            "cached": cached,
            "flags": flags,
            # Which attempt of the request this was (migrations before it).
            "attempt": marks.attempt(hdrs.get(H.MIGRATION)),
        }
        spend = hdrs.get(H.SPEND)
        if spend and owner:
            # The request held spend: any limiter may settle it (the report is kept until
            # one has), the one that admitted it first.
            body["spend"] = spend
            if duplicate:
                body["dup"] = duplicate
            return subjects.usage_spend(owner), codec.encode(body)
        # A number beyond 64 bits (``Tb-Ratelimit: 9…9,40,wc,x``) cannot be encoded.
        return subjects.usage(owner or None), codec.encode(body)
    except (KeyError, ValueError, E.TokenbusError):
        return None


async def report(
    nc: NATS,
    hdrs: dict[str, str],
    rid: str,
    *,
    max_tokens: int = 0,
    prompt_tokens: int = 0,
    completion: int = 0,
    cached: int = 0,
) -> None:
    """Tell the limiter what the request used (fire and forget; never raises). The defaults
    say it used nothing: it ended before an engine ran it."""
    out = report_body(
        hdrs,
        rid,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        completion=completion,
        cached=cached,
    )
    if out is None:
        return
    with contextlib.suppress(Exception):
        # To the limiter instance that admitted the request: it holds the request's slot.
        await nc.publish(*out)

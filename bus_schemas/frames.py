"""Stream frames on the hot path, built as plain dicts (schemas in :mod:`bus_schemas.messages`).

A stream is one accept frame, chunk frames, then exactly one final or error frame.
"""

from __future__ import annotations

from typing import Any

from bus_schemas import codec
from bus_schemas.errors import TokenbusError

ACCEPT = "a"
CHUNK = "c"
FINAL = "f"
ERROR = "e"
BATCH = "b"
# Sent on a stream every heartbeat interval to a caller that cannot see heartbeats
# (``Tb-Keepalive``): the replica is alive; ``b``/``e`` are its boot id and connection epoch
# (an epoch that changes mid-stream means frames may have been lost).
ALIVE = "k"
# Sent by a stage or router that has held a request for a while without passing it on (a
# key check, a full queue): it is alive and the request is not lost, so the caller does
# not send it again. Callers skip frame types they do not know, so older ones ignore it.
HOLD = "h"


def accept(
    replica: str,
    request_id: str,
    heartbeat_s: float,
    ratelimit_info: str | None = None,
    admission: str | None = None,
    traceparent: str | None = None,
    service_tier: str | None = None,
    no_resume: bool = False,
) -> bytes:
    frame: dict[str, Any] = {
        "t": ACCEPT,
        "replica": replica,
        "request_id": request_id,
        "heartbeat_s": heartbeat_s,
    }
    if ratelimit_info:
        frame["rl"] = ratelimit_info
    if admission:  # the ratelimit stage's ticket, for a migration of this request
        frame["adm"] = admission
    if traceparent:  # the replica's span (tracing on): a migration of the request links it
        frame["tp"] = traceparent
    if service_tier:  # the class that serves it (engine_worker/flow.py)
        frame["tier"] = service_tier
    if no_resume:  # its engine cannot continue this answer elsewhere cut off: no migration
        frame["nr"] = 1
    return codec.encode(frame)


def chunk(text: str, ntokens: int, index: int, side: dict[str, Any] | None = None) -> bytes:
    """A chunk frame; ``side`` adds output other than text under its wire keys (``tc`` tool
    calls, ``lp`` logprobs, ``rf`` refusal, ``rs`` reasoning, ``em`` an embedding)."""
    if side:
        return codec.encode({"t": CHUNK, "d": text, "n": ntokens, "i": index, **side})
    return codec.encode({"t": CHUNK, "d": text, "n": ntokens, "i": index})


def final(
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    timings: dict[str, int],
    usage_details: dict[str, Any] | None = None,
    stop_sequence: str | None = None,
    usage_source: str | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> bytes:
    """The final frame; ``usage_details`` adds the engine's ``prompt_tokens_details`` and
    ``completion_tokens_details`` to the usage, ``stop_sequence`` the stop string that ended
    a ``stop`` finish (left out when none did), ``usage_source`` where the prompt's count
    came from when the engine did not count it (``upstream``, ``tokenized``, ``estimate``)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if usage_details:
        usage.update(usage_details)
    frame: dict[str, Any] = {
        "t": FINAL,
        "finish_reason": finish_reason,
        "usage": usage,
        "timings": timings,
    }
    if stop_sequence is not None:
        frame["stop_sequence"] = stop_sequence
    if usage_source is not None:
        frame["usage_source"] = usage_source
    if kv_transfer_params is not None:  # a prefill's hand-over (docs/disaggregation.md)
        frame["kvt"] = kv_transfer_params
    return codec.encode(frame)


def alive(boot: str, epoch: int) -> bytes:
    return codec.encode({"t": ALIVE, "b": boot, "e": epoch})


HOLD_FRAME = codec.encode({"t": HOLD})


def error(err: TokenbusError) -> bytes:
    return codec.encode({"t": ERROR, "error": err.to_dict()})


def decode(data: bytes) -> dict[str, Any]:
    return codec.decode_map(data)


def batch(items: list[tuple[str, bytes]]) -> bytes:
    """Frames for several streams of one client: ``[(stream token, frame), ...]`` in order."""
    return codec.encode({"t": BATCH, "f": items})

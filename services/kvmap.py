"""A JetStream KV bucket used as a map from model names to JSON values (the run-time routing
changes, ``tokenbus_routing``, and the model aliases, ``tokenbus_aliases``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus_schemas import subjects
from services import buckets

T = TypeVar("T")


def kv_key(name: str) -> str:
    """A model name as a KV key (KV keys allow ``=`` but not the ``~`` of subject tokens)."""
    return subjects.token(name).replace("~", "=")


def name_of(key: str) -> str:
    """Reverse :func:`kv_key`."""
    return subjects.untoken(key.replace("=", "~"))


def json_value(value: bytes) -> Any:
    """A stored value as JSON; None when it is not JSON."""
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return None


async def open_bucket(nc: NATS, bucket: str) -> KeyValue:
    """``bucket``, created (one version per key) when missing."""
    return await buckets.open_kv(nc.jetstream(), bucket)


async def current(kv: KeyValue, name: str, parse: Callable[[bytes], T | None]) -> T | None:
    """``name``'s value now (``parse``d), None when it has none."""
    try:
        entry = await kv.get(kv_key(name))
    except KeyNotFoundError:
        return None
    return parse(entry.value) if entry.value else None


async def entries(kv: KeyValue, parse: Callable[[bytes], T | None]) -> dict[str, T]:
    """Every name and its value (``parse``d; what it refuses is skipped)."""
    out: dict[str, T] = {}
    for k in await buckets.keys(kv):
        with contextlib.suppress(KeyNotFoundError, ValueError):
            entry = await kv.get(k)
            value = parse(entry.value) if entry.value else None
            if value is not None:
                out[name_of(k)] = value
    return out

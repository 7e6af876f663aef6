"""A JetStream KV bucket used as a map from model names to JSON values (the run-time routing
changes, ``tokenbus_routing``, the model aliases, ``tokenbus_aliases``, and the LoRA adapters
loaded at run time, ``tokenbus_adapters``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any, Generic, TypeVar

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


class Table(Generic[T]):
    """A bucket's entries as a map, name -> ``parse(value)``, following every change of the
    bucket (what auth stages, routers and bridges keep of the run-time aliases and adapters).
    A value ``parse`` refuses (not written by tokenbus) is skipped with a warning."""

    def __init__(
        self, bucket: str, parse: Callable[[bytes], T | None], log: Any = None, what: str = ""
    ) -> None:
        self.bucket = bucket
        self.parse = parse
        self.log = log
        self.what = what or bucket
        self.values: dict[str, T] = {}
        self._follow: buckets.Follow | None = None

    async def watch(self, nc: NATS) -> None:
        """Follow the bucket (created if missing); waits (up to 10 s) for its values now."""
        self._follow = await buckets.Follow(await open_bucket(nc, self.bucket), self._apply).start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._follow.synced.wait(), 10)

    def _apply(self, entry: Any) -> None:
        try:
            name = name_of(entry.key)
        except ValueError:
            return
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.values.pop(name, None)
        elif (value := self.parse(entry.value)) is not None:
            self.values[name] = value
        else:
            if self.log is not None:
                self.log.warning(
                    f"{self.what}_change_invalid", bucket=self.bucket, key=entry.key[:200]
                )
            return
        if self.log is not None:
            self.log.info(f"{self.what}_changed", name=name, value=str(self.values.get(name)))

    async def close(self) -> None:
        if self._follow is not None:
            await self._follow.close()

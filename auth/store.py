"""Keys in JetStream KV: every auth instance, bridge and restart sees the same keys.

Each instance keeps a cache fed by a KV watch, so a revocation or an update reaches every
instance as fast as NATS delivers it (milliseconds), well inside the one second promised.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from auth.keys import KeyRecord, hash_key, key_id_of, matches, new_key
from bus_schemas import errors as E

BUCKET = "tokenbus_keys"


class KeyStore:
    """Create, read, update and revoke keys; look keys up from a watched cache."""

    def __init__(self, nc: NATS, bucket: str = BUCKET) -> None:
        self.nc = nc
        self.bucket = bucket
        self.kv: KeyValue | None = None
        self._cache: dict[str, KeyRecord] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self._watcher: Any = None
        self.synced = asyncio.Event()

    async def open(self, *, watch: bool = True) -> KeyStore:
        js = self.nc.jetstream()
        try:
            self.kv = await js.key_value(self.bucket)
        except BucketNotFoundError:
            self.kv = await js.create_key_value(bucket=self.bucket, history=1)
        if watch:
            self._watcher = await self.kv.watchall()
            self._watch_task = asyncio.get_running_loop().create_task(self._follow())
            await asyncio.wait_for(self.synced.wait(), 10)
        return self

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()

    async def _follow(self) -> None:
        async for entry in self._watcher:
            if entry is None:  # end of the initial values
                self.synced.set()
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._cache.pop(entry.key, None)
                continue
            with contextlib.suppress(ValueError):
                self._cache[entry.key] = KeyRecord.model_validate_json(entry.value)

    def _kv(self) -> KeyValue:
        if self.kv is None:
            raise RuntimeError("KeyStore.open() first")
        return self.kv

    # -- administration ---------------------------------------------------------------------
    async def create(self, name: str, **fields: Any) -> tuple[str, KeyRecord]:
        """A new key; the key itself is returned here and never again."""
        key, key_id = new_key()
        rec = KeyRecord(id=key_id, name=name, hash=hash_key(key), **fields)
        await self._kv().create(key_id, rec.model_dump_json().encode())
        self._cache[key_id] = rec
        return key, rec

    async def get(self, key_id: str) -> KeyRecord:
        try:
            entry = await self._kv().get(key_id)
        except KeyNotFoundError:
            raise E.NotFound(f"no key with id {key_id!r}") from None
        if not entry.value:
            raise E.NotFound(f"no key with id {key_id!r}")
        return KeyRecord.model_validate_json(entry.value)

    async def list(self) -> list[KeyRecord]:
        try:
            ids = await self._kv().keys()
        except Exception:  # nats-py raises NoKeysError on an empty bucket
            return []
        out = []
        for key_id in ids:
            with contextlib.suppress(E.NotFound):
                out.append(await self.get(key_id))
        return sorted(out, key=lambda r: r.created_at)

    async def update(self, key_id: str, **fields: Any) -> KeyRecord:
        rec = await self.get(key_id)
        new = rec.model_copy(update={k: v for k, v in fields.items() if v is not None})
        KeyRecord.model_validate(new.model_dump())
        await self._kv().put(key_id, new.model_dump_json().encode())
        self._cache[key_id] = new
        return new

    async def revoke(self, key_id: str) -> KeyRecord:
        return await self.update(key_id, enabled=False)

    # -- authentication ---------------------------------------------------------------------
    def lookup(self, key: str | None) -> KeyRecord:
        """The record of a presented key, or :class:`E.Unauthorized` (never says which part
        was wrong beyond what the caller already knows)."""
        if not key:
            raise E.Unauthorized(
                "no API key: send it as 'Authorization: Bearer <key>' (HTTP) or in the "
                "Tb-Api-Key header (NATS)"
            )
        key_id = key_id_of(key)
        rec = self._cache.get(key_id) if key_id else None
        if rec is None or not matches(key, rec):
            raise E.Unauthorized("the API key is not valid")
        if not rec.enabled:
            raise E.Unauthorized(f"the API key {rec.id} has been revoked")
        if rec.expired(time.time()):
            raise E.Unauthorized(f"the API key {rec.id} has expired")
        return rec

    def authorize(self, rec: KeyRecord, model: str) -> None:
        if rec.models and model not in rec.models:
            raise E.Forbidden(
                f"the API key {rec.id} may not use the model {model!r}", param="model"
            )

"""Keys in JetStream KV: every auth instance, bridge and restart sees the same keys.

Each instance keeps a cache fed by a KV watch, so a revocation or an update reaches every
instance as fast as NATS delivers it (milliseconds), well inside the one second promised.

Administrative changes name their ``actor`` (``key:<admin key id>``, ``cli:<user>@<host>``):
each is then recorded in the audit trail (:mod:`services.audit`), and refused when it
cannot be. Without an actor (tests, internal tools) nothing is recorded.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from auth.keys import KeyRecord, hash_key, key_id_of, matches, new_key
from bus_schemas import errors as E
from services import audit, buckets

BUCKET = "tokenbus_keys"


class KeyStore:
    """Create, read, update and revoke keys; look keys up from a watched cache."""

    def __init__(self, nc: NATS, bucket: str = BUCKET) -> None:
        self.nc = nc
        self.bucket = bucket
        self.kv: KeyValue | None = None
        self._cache: dict[str, KeyRecord] = {}
        self._missed: dict[str, float] = {}  # key id -> when a read found none (catch_up)
        # key id -> the bucket revision its cached record came from: a read (catch_up) and
        # the watch both apply only what is newer, so a stale read never undoes an update.
        self._revs: dict[str, int] = {}
        self._follow: buckets.Follow | None = None
        # Entries applied from the bucket so far: tells a watcher (the console's feed) that
        # something changed without it comparing every record.
        self.changes = 0

    async def open(self, *, watch: bool = True) -> KeyStore:
        self.kv = await buckets.open_kv(self.nc.jetstream(), self.bucket)
        if watch:
            self._follow = await buckets.Follow(self.kv, self._apply).start()
            await asyncio.wait_for(self._follow.synced.wait(), 10)
        return self

    async def close(self) -> None:
        if self._follow is not None:
            await self._follow.close()

    def _apply(self, entry: Any) -> None:
        self.changes += 1
        rev = int(entry.revision or 0)
        if rev and rev < self._revs.get(entry.key, 0):
            return  # read from the bucket already (catch_up), newer than this
        if rev:
            self._revs[entry.key] = rev
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self._cache.pop(entry.key, None)
            return
        with contextlib.suppress(ValueError):
            self._cache[entry.key] = KeyRecord.model_validate_json(entry.value)

    def _kv(self) -> KeyValue:
        if self.kv is None:
            raise RuntimeError("KeyStore.open() first")
        return self.kv

    # -- administration ---------------------------------------------------------------------
    async def create(
        self, name: str, *, actor: str | None = None, request_id: str | None = None, **fields: Any
    ) -> tuple[str, KeyRecord]:
        """A new key; the key itself is returned here and never again (nor audited)."""
        key, key_id = new_key()
        rec = KeyRecord(id=key_id, name=name, hash=hash_key(key), **fields)
        try:
            async with audit.change(
                self.nc, audit.KEY_CREATED, key_id, actor, request_id=request_id
            ) as change:
                await buckets.create(self._kv(), key_id, rec.model_dump_json().encode())
                self._cache[key_id] = rec
                change.details = rec.model_dump(exclude={"id", "hash", "created_at", "enabled"})
        except audit.AuditIncomplete as exc:
            # Nobody has seen the key yet: take it back, so the trail misses nothing.
            try:
                await self._kv().delete(key_id)
            except Exception:
                raise exc from None
            self._cache.pop(key_id, None)
            raise audit.AuditUnavailable(
                f"{exc.reason}; the new key {key_id} was deleted again, nothing was created"
            ) from None
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
        ids = await buckets.keys(self._kv())
        out = []
        for key_id in ids:
            with contextlib.suppress(E.NotFound):
                out.append(await self.get(key_id))
        return sorted(out, key=lambda r: r.created_at)

    def records(self) -> builtins.list[KeyRecord]:  # (``list`` is a method here)
        """Every key this store has followed (revoked ones too), oldest first: no reads, for
        listings of many keys (:meth:`list` reads the bucket)."""
        return sorted(self._cache.values(), key=lambda r: r.created_at)

    async def update(
        self,
        key_id: str,
        *,
        actor: str | None = None,
        request_id: str | None = None,
        **fields: Any,
    ) -> KeyRecord:
        """Set the fields given (None: leave as is)."""
        changes = {k: v for k, v in fields.items() if v is not None}
        async with audit.change(
            self.nc, audit.KEY_UPDATED, key_id, actor, request_id=request_id
        ) as change:
            rec, new = await self._update(key_id, changes)
            shown = [k for k in changes if k != "hash"]
            change.details = {
                "changes": {k: getattr(new, k, None) for k in shown},
                "previous": {k: getattr(rec, k, None) for k in shown},
            }
        return new

    async def revoke(
        self, key_id: str, *, actor: str | None = None, request_id: str | None = None
    ) -> KeyRecord:
        async with audit.change(
            self.nc, audit.KEY_REVOKED, key_id, actor, request_id=request_id
        ) as change:
            rec, new = await self._update(key_id, {"enabled": False})
            change.details = {"name": rec.name, "was_enabled": rec.enabled}
        return new

    async def rotate(
        self,
        key_id: str,
        *,
        overlap_s: float = 3600.0,
        actor: str | None = None,
        request_id: str | None = None,
    ) -> tuple[str, KeyRecord]:
        """A new secret for ``key_id``: the same id, so the same limits, budget and spend
        (both are kept by key id); the key before it keeps working for ``overlap_s`` (0: it
        stops at once), so clients can move over. The new key is returned here and never
        again (nor audited)."""
        if overlap_s < 0:
            raise E.InvalidRequest("the overlap must not be negative", param="overlap")
        key, _ = new_key(key_id)
        now = time.time()
        async with audit.change(
            self.nc, audit.KEY_ROTATED, key_id, actor, request_id=request_id
        ) as change:
            rec = await self.get(key_id)
            if not rec.enabled:
                raise E.InvalidRequest(f"the key {key_id} is revoked: nothing to rotate")
            until = now + overlap_s if overlap_s > 0 else None
            _, new = await self._update(
                key_id,
                {
                    "hash": hash_key(key),
                    "previous_hash": rec.hash if until else "",
                    "previous_until": until,
                    "rotated_at": now,
                },
            )
            change.details = {"name": rec.name, "previous_key_works_until": until}
        return key, new

    async def _update(self, key_id: str, changes: dict[str, Any]) -> tuple[KeyRecord, KeyRecord]:
        """(the record before, after) ``changes``."""
        rec = await self.get(key_id)
        new = rec.model_copy(update=changes)
        KeyRecord.model_validate(new.model_dump())
        await self._kv().put(key_id, new.model_dump_json().encode())
        self._cache[key_id] = new
        return rec, new

    # -- authentication ---------------------------------------------------------------------
    def record(self, key_id: str) -> KeyRecord | None:
        """The cached record of ``key_id`` (None when there is none)."""
        return self._cache.get(key_id)

    async def catch_up(self, key: str | None) -> None:
        """Before :meth:`lookup` of a presented ``key``: when its id is not in the cache, or
        the cached record does not take this secret, read it from the bucket (a key made or
        rotated a moment ago, or while this store's watch was on a node that stalled, reaches
        the watch later). An id read and not taken is not read again for a second, so wrong
        secrets cost the bucket one read a second per id at most."""
        key_id = key_id_of(key) if key else None
        if not key_id or self.kv is None:
            return
        cached = self._cache.get(key_id)
        if cached is not None and matches(str(key), cached):
            return
        now = time.monotonic()
        if now - self._missed.get(key_id, -60.0) < 1.0:
            return
        if len(self._missed) > 10_000:
            self._missed.clear()
        try:
            # From the stream's leader (a key made a moment ago through another node was
            # refused when a replica that had not applied it answered: a stalled-node test).
            msg = await buckets.leader_read(self._kv(), key_id)
        except Exception as exc:
            if cached is not None:
                return  # the cache decides while the store does not answer
            # Not known here and the store did not say: retryable, not "not valid".
            raise E.ServiceUnavailable(
                f"the key store did not answer ({type(exc).__name__}); retry shortly",
                headers={"Retry-After": "1"},
            ) from None
        try:
            rec = None if msg is None else KeyRecord.model_validate_json(msg.data or b"")
        except ValueError:  # not a key record
            rec = None
        if msg is None or rec is None:  # none such, or not a key record: refused
            self._missed[key_id] = now
            return
        if not matches(str(key), rec):
            self._missed[key_id] = now
        rev = int(msg.seq or 0)
        if cached is None or rev > self._revs.get(key_id, 0):
            # Newer than what the watch delivered (its next deliveries, older, are skipped).
            self._cache[key_id] = rec
            self._revs[key_id] = rev

    def by_id(self, key_id: str) -> KeyRecord:
        """The record of ``key_id`` for work the key submitted earlier and a trusted service
        now runs on its behalf (a batch's lines): :class:`E.Unauthorized` when the key is
        gone, revoked or expired since."""
        rec = self._cache.get(key_id)
        if rec is None:
            raise E.Unauthorized(f"the API key {key_id} no longer exists")
        return self._valid(rec)

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
        return self._valid(rec)

    @staticmethod
    def _valid(rec: KeyRecord) -> KeyRecord:
        if not rec.enabled:
            raise E.Unauthorized(f"the API key {rec.id} has been revoked")
        if rec.expired(time.time()):
            raise E.Unauthorized(f"the API key {rec.id} has expired")
        return rec

    def authorize(self, rec: KeyRecord, model: str, served: str | None = None) -> None:
        """403 unless ``rec`` may use ``model``: its allow-list is empty or names ``model``,
        or, for an alias of it, the ``served`` model."""
        if rec.models and model not in rec.models and (served or model) not in rec.models:
            raise E.Forbidden(
                f"the API key {rec.id} may not use the model {model!r}", param="model"
            )

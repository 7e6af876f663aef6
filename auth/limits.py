"""Distributed rate limits: requests/minute, tokens/minute and concurrent requests per key,
held exactly across any number of limiter instances.

The mechanism: counters in a JetStream KV bucket (memory storage, entries expire after a
few minutes), changed only by compare-and-set on the entry's revision. Two instances that
race on one key both read revision n; one writes n+1, the other's write is refused and it
retries on the new value. So the limit holds for the key across all instances (not
limit times instances), and a limiter restart loses nothing: the state lives in the NATS server.

* RPM and TPM use fixed one-minute windows (``rl.<key>.<minute>``): never more than the
  limit is admitted in a window.
* TPM is reserved at admission (prompt estimate + max_tokens) and reconciled with the real
  usage the worker reports when the request ends.
* Concurrency is a set of (request, expiry) leases (``cc.<key>``): a request that never
  reports back (its worker died) frees its slot at its deadline.

Failure behaviour: when the KV store cannot be reached the limiter fails open (admits and
logs) or closed (503), per ``ratelimit.fail_open``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from bus_schemas import errors as E

Change = Callable[[dict[str, Any]], dict[str, Any]]

BUCKET = "tokenbus_ratelimit"
WINDOW_S = 60
_MAX_CAS_TRIES = 100


@dataclass
class Admission:
    """An admitted request: what to reconcile later and what to tell the caller."""

    window: int
    reserved: int
    info: dict[str, str]


def info_header(info: dict[str, str]) -> str:
    return ";".join(f"{k}={v}" for k, v in info.items())


def parse_info(value: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in (value or "").split(";"):
        k, _, v = part.partition("=")
        if k and v:
            out[k] = v
    return out


class Limiter:
    """RPM, TPM and concurrency per principal over a shared KV bucket."""

    def __init__(self, nc: NATS, bucket: str = BUCKET) -> None:
        self.nc = nc
        self.bucket = bucket
        self.kv: KeyValue | None = None
        self._queues: dict[str, list[tuple[Change, asyncio.Future[Any]]]] = {}
        self._busy: set[str] = set()

    async def open(self) -> Limiter:
        js = self.nc.jetstream()
        try:
            self.kv = await js.key_value(self.bucket)
        except BucketNotFoundError:
            self.kv = await js.create_key_value(
                bucket=self.bucket, history=1, ttl=3 * WINDOW_S, storage=StorageType.MEMORY
            )
        return self

    def _kv(self) -> KeyValue:
        if self.kv is None:
            raise RuntimeError("Limiter.open() first")
        return self.kv

    async def _cas(
        self, key: str, change: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> dict[str, Any]:
        """Apply ``change`` to the entry at ``key`` atomically; ``change`` may raise.

        Changes to one key from this instance are batched: while one compare-and-set is in
        flight, later ones queue and go together in the next, applied in arrival order. A
        hot key then costs one KV round trip per batch, and at most one writer per limiter
        instance races on it, instead of one per request.
        """
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        queue = self._queues.setdefault(key, [])
        queue.append((change, fut))
        if key not in self._busy:
            self._busy.add(key)
            try:
                while self._queues.get(key):
                    batch = self._queues.pop(key)
                    try:
                        await self._cas_batch(key, batch)
                    except Exception as exc:
                        for _, f in batch:
                            if not f.done():
                                f.set_exception(exc)
            finally:
                self._busy.discard(key)
        return await fut

    async def _cas_batch(self, key: str, batch: list[tuple[Change, asyncio.Future[Any]]]) -> None:
        kv = self._kv()
        for _ in range(_MAX_CAS_TRIES):
            try:
                entry = await kv.get(key)
                state = json.loads(entry.value) if entry.value else {}
                rev: int | None = entry.revision
            except KeyNotFoundError:
                state, rev = {}, None
            outcomes: list[dict[str, Any] | Exception] = []
            for change, _ in batch:
                try:
                    state = change(dict(state))
                    outcomes.append(state)
                except E.TokenbusError as exc:  # refused: the state stays as it was
                    outcomes.append(exc)
            data = json.dumps(state, separators=(",", ":")).encode()
            try:
                if rev is None:
                    await kv.create(key, data)
                else:
                    await kv.update(key, data, last=rev)
            except KeyWrongLastSequenceError:
                continue  # another instance won this round: read again, redo the batch
            for (_, fut), out in zip(batch, outcomes, strict=True):
                if fut.done():
                    continue
                if isinstance(out, Exception):
                    fut.set_exception(out)
                else:
                    fut.set_result(out)
            return
        raise E.ServiceUnavailable("rate limiter contention: retry")

    async def admit(
        self,
        principal: str,
        request_id: str,
        *,
        rpm: int | None,
        tpm: int | None,
        concurrent: int | None,
        tokens: int,
        deadline_s: float,
    ) -> Admission:
        """Count the request against every limit of ``principal`` or raise RateLimited."""
        now = time.time()
        window = int(now // WINDOW_S)
        reset = (window + 1) * WINDOW_S - now
        info: dict[str, str] = {}
        if rpm is not None or tpm is not None:

            def count(cur: dict[str, Any]) -> dict[str, Any]:
                r, t = int(cur.get("r", 0)), int(cur.get("t", 0))
                if rpm is not None and r + 1 > rpm:
                    raise self._limited("requests", rpm, 0, reset, tpm, t)
                if tpm is not None and t + tokens > tpm:
                    raise self._limited(
                        "tokens", tpm, max(0, tpm - t), reset, tpm, t, rpm=rpm, used_r=r
                    )
                return {"r": r + 1, "t": t + tokens}

            new = await self._cas(f"rl.{principal}.{window}", count)
            if rpm is not None:
                info.update(self._trio("requests", rpm, rpm - new["r"], reset))
            if tpm is not None:
                info.update(self._trio("tokens", tpm, tpm - new["t"], reset))
        if concurrent is not None:

            def take(cur: dict[str, Any]) -> dict[str, Any]:
                live = {k: v for k, v in cur.items() if float(v) > now}
                if len(live) + 1 > concurrent:
                    raise E.RateLimited(
                        f"too many concurrent requests for this key (limit {concurrent}); "
                        "retry when one finishes",
                        headers={"Retry-After": "1", **info},
                    )
                live[request_id] = deadline_s
                return live

            try:
                await self._cas(f"cc.{principal}", take)
            except E.RateLimited:
                if rpm is not None or tpm is not None:
                    await self._undo(principal, window, tokens)
                raise
        return Admission(window, tokens, info)

    async def _undo(self, principal: str, window: int, tokens: int) -> None:
        def back(cur: dict[str, Any]) -> dict[str, Any]:
            return {
                "r": max(0, int(cur.get("r", 0)) - 1),
                "t": max(0, int(cur.get("t", 0)) - tokens),
            }

        await self._cas(f"rl.{principal}.{window}", back)

    async def settle(
        self,
        principal: str,
        request_id: str,
        window: int,
        reserved: int,
        used: int,
        *,
        concurrent: bool = True,
        windowed: bool = True,
    ) -> None:
        """Reconcile the reservation with real usage and free the concurrency slot."""
        if windowed and used != reserved:

            def adjust(cur: dict[str, Any]) -> dict[str, Any]:
                return {
                    "r": int(cur.get("r", 0)),
                    "t": max(0, int(cur.get("t", 0)) + used - reserved),
                }

            await self._cas(f"rl.{principal}.{window}", adjust)
        if concurrent:

            def release(cur: dict[str, Any]) -> dict[str, Any]:
                cur.pop(request_id, None)
                return cur

            await self._cas(f"cc.{principal}", release)

    @staticmethod
    def _trio(kind: str, limit: int, remaining: int, reset: float) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{kind}": str(limit),
            f"x-ratelimit-remaining-{kind}": str(max(0, remaining)),
            f"x-ratelimit-reset-{kind}": f"{math.ceil(reset)}s",
        }

    def _limited(
        self,
        kind: str,
        limit: int,
        remaining: int,
        reset: float,
        tpm: int | None,
        used_t: int,
        *,
        rpm: int | None = None,
        used_r: int = 0,
    ) -> E.RateLimited:
        headers = {
            "Retry-After": str(math.ceil(reset)),
            **self._trio(kind, limit, remaining, reset),
        }
        if kind == "requests" and tpm is not None:
            headers.update(self._trio("tokens", tpm, tpm - used_t, reset))
        if kind == "tokens" and rpm is not None:
            headers.update(self._trio("requests", rpm, rpm - used_r, reset))
        per = "requests" if kind == "requests" else "tokens"
        return E.RateLimited(
            f"rate limit reached for this key: {limit} {per} per minute; retry in "
            f"{math.ceil(reset)} s",
            headers=headers,
        )

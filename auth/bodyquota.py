"""A bound on what one API key's large request bodies hold in the shared store of them.

A key's NATS connection may write its claim-checked bodies under ``tb.v1.body.tbk.<key
id>.>`` (auth/callout.py) and may neither read nor delete them, so nothing on the bus stops
it from writing chunks and never sending a request: one key could fill the 4 GiB every
tenant's large requests share (docs/large-requests.md, "Who may do what"). nats-server has
no limit that fits (a stream's ``max_msgs_per_subject`` counts messages of one exact
subject, each chunk has its own; account limits need an account per key), so the auth
service, which grants that permission, keeps the bound itself:

* It follows the bodies stream with an ordered, headers-only consumer (a chunk's size comes
  in ``Nats-Msg-Size``, not its bytes) from its first message, and sums what each key's
  owner holds, as nats-server stores it, over the stream's age limit.
* Past the key's quota (``bodies.max_bytes_per_key``, or the key's ``max_body_bytes``) it
  counts again from the stream itself (a consumer on the key's subjects only) and, if the
  key really holds more, purges every chunk of that key up to the last one counted, then
  leaves a notice (``tb.v1.body.quota.<key id>``) so that a reader finding an object gone
  tells the caller why (services/bodies.py: 429 naming the quota). Logged once per purge,
  counted in ``tokenbus_body_quota_purges_total``.
* The keys of one owner (a key record's ``owner``: a tenant with several keys) are bound
  together too (``bodies.max_bytes_per_owner``): past it every key of the owner is counted
  again from the stream, and the bodies of the key holding the most are purged, then the
  next's, until the owner is under it; the notice then names the owner's bound.
* A key's connection says a body is done when its stream ends (``<object>.done``, under its
  own owner, which only it may write); the janitor deletes that object for it, so a key's
  finished requests do not count against it for the age limit's 15 minutes.

Several auth instances each run one and agree without talking: the sums are only a cheap
trigger (they over-count what another instance removed); the decision to purge is taken on
a fresh count of the stream, and a purge names a sequence bound, so a second instance's
purge of the same bodies removes nothing (and is neither logged nor counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from prometheus_client import Counter, Gauge

from auth.store import KeyStore
from bus_schemas import subjects
from services import bodies, buckets

# Each message counts as at least this much: a key writing many tiny messages (cheap in bytes,
# but each a subject nats-server indexes) reaches its quota after quota / 64 KiB of them
# (4096 at the default), while a real body's chunks are 256 KiB but its last.
MIN_CHARGE = 64 * 1024
# What nats-server's file store adds to a message's subject, headers and data: a record's
# header (22 bytes) and checksum (8).
STORED_OVERHEAD = 30
# The header a headers-only consumer carries a message's data size in (set by nats-server: a
# publisher's own is replaced), and the size of one it did not say: the largest the stream takes.
MSG_SIZE = "Nats-Msg-Size"
UNKNOWN_SIZE = bodies.CHUNK + 4096
# Done objects waiting to be deleted, and deletes at once: past the queue's bound a done
# marker is not acted on (the object then counts until it expires), so a key cannot make the
# janitor issue purges faster than these few at a time.
MAX_DELETES = 1024
DELETERS = 4
# Chunks read per fetch when counting a key again.
RECOUNT_BATCH = 256
# How often the janitor checks the stream it follows is there and the same (tries again when
# it cannot reach it), and forgets keys whose bodies all expired.
RETRY_S = 5.0
SWEEP_S = 30.0

PURGES = Counter(
    "tokenbus_body_quota_purges_total",
    "Times a key's large request bodies were removed for holding more than its quota "
    "(bodies.max_bytes_per_key) in the store",
)
PURGED = Counter(
    "tokenbus_body_quota_purged_chunks_total",
    "Chunks of keys' large request bodies removed for their quota",
)
DELETED = Counter(
    "tokenbus_bodies_done_deleted_total",
    "Body objects of keys' connections deleted when their request ended (done markers)",
)
HEARD = Gauge(
    "tokenbus_body_quota_heard_seq",
    "The bodies stream's sequence up to which this auth instance's janitor has accounted for "
    "every chunk (a check of a key over its quota included)",
)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One message in the bodies stream, as the janitor counts it."""

    seq: int
    at: float  # when nats-server stored it (unix seconds)
    object_id: str
    charge: int


def charge(msg: Msg) -> int:
    """What a message delivered headers-only holds in the store: its data (the server's
    ``Nats-Msg-Size``, which a publisher cannot set), subject, headers and record overhead;
    at least :data:`MIN_CHARGE`."""
    hdrs = dict(msg.headers or {})
    try:
        size = int(hdrs.pop(MSG_SIZE, UNKNOWN_SIZE))
    except ValueError:
        size = UNKNOWN_SIZE
    # "NATS/1.0\r\n", "key: value\r\n" each, "\r\n"
    head = 12 + sum(len(k) + len(v) + 4 for k, v in hdrs.items()) if hdrs else 0
    return max(MIN_CHARGE, STORED_OVERHEAD + len(msg.subject) + head + size)


class Tally:
    """What one key's owner holds in the bodies stream as this janitor heard it: chunks in
    stream order, and the sequence up to which a count of the stream itself replaced them."""

    __slots__ = ("chunks", "floor", "total")

    def __init__(self) -> None:
        self.chunks: deque[Chunk] = deque()
        self.total = 0
        self.floor = 0

    def add(self, chunk: Chunk) -> None:
        """Count ``chunk`` unless a count of the stream already has (or removed) it."""
        if chunk.seq > self.floor:
            self.chunks.append(chunk)
            self.total += chunk.charge

    def holds(self, object_id: str) -> bool:
        return any(c.object_id == object_id for c in self.chunks)

    def drop_object(self, object_id: str) -> None:
        """Forget the chunks of ``object_id`` (deleted)."""
        self._keep(lambda c: c.object_id != object_id)

    def expire(self, before: float) -> None:
        """Forget chunks stored before ``before`` (the stream's age limit removed them)."""
        while self.chunks and self.chunks[0].at < before:
            self.total -= self.chunks.popleft().charge

    def replace(self, counted: list[Chunk], floor: int) -> None:
        """Take a count of the stream: ``counted`` is every chunk of the key up to ``floor``
        (any other heard up to there is gone); what was heard after stays."""
        later = [c for c in self.chunks if c.seq > floor]
        self.chunks = deque([*counted, *later])
        self.total = sum(c.charge for c in self.chunks)
        self.floor = max(self.floor, floor)

    def cut(self, floor: int) -> None:
        """Forget every chunk up to ``floor`` (purged)."""
        self._keep(lambda c: c.seq > floor)
        self.floor = max(self.floor, floor)

    def _keep(self, keep: Any) -> None:
        self.chunks = deque(c for c in self.chunks if keep(c))
        self.total = sum(c.charge for c in self.chunks)


class BodyQuota:
    """The auth service's janitor of keys' large request bodies (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        keys: KeyStore,
        default_max: int,
        log: Any,
        *,
        owner_max: int = 0,
        ttl_s: float = bodies.TTL_S,
    ) -> None:
        self.nc = nc
        self.keys = keys
        self.default_max = default_max
        self.owner_max = owner_max  # all the keys of one key owner (a tenant) together
        self.log = log
        self.ttl_s = ttl_s
        self.tallies: dict[str, Tally] = {}
        self.tenants: dict[str, set[str]] = {}  # a key record's owner -> its keys' tallies
        self._heard = 0  # the last stream sequence heard
        # Checks in flight: a key's (by its subject owner) and a tenant's ("tenant:" + owner).
        self._checks: dict[str, tuple[int, asyncio.Task[None]]] = {}  # -> (seq, task)
        self._deletes: asyncio.Queue[tuple[str, str]] = asyncio.Queue(MAX_DELETES)
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Any = None
        self._created: Any = None  # when the stream followed was made (it may be made again)
        self._said_unreachable = False

    def tenant(self, key_id: str) -> str:
        """The owner of key ``key_id`` as its record names it ("": none, or unknown here)."""
        rec = self.keys.record(key_id)
        return rec.owner if rec is not None and rec.owner else ""

    def quota(self, key_id: str) -> int:
        """What key ``key_id``'s bodies may hold (0: no bound)."""
        rec = self.keys.record(key_id)
        if rec is not None and rec.max_body_bytes is not None:
            return rec.max_body_bytes
        return self.default_max

    async def start(self) -> None:
        """Follow the bodies stream (in the background, until it can: it may not exist yet)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow())]
        self._tasks += [loop.create_task(self._deleter()) for _ in range(DELETERS)]

    async def stop(self) -> None:
        tasks = [*self._tasks, *(t for _, t in self._checks.values())]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _follow(self) -> None:
        """Follow the stream; every :data:`RETRY_S`, check it is still the one followed (a
        stream deleted and made again starts its sequences over, which nats-py's ordered
        consumer does not see: it would go on from the old one's) and forget expired chunks."""
        swept = time.monotonic()
        while True:
            try:
                info = await buckets.open_stream(self.nc.jetstream(), bodies.config())
                if self._sub is None or info.created != self._created:
                    await self._subscribe(info)
                self._said_unreachable = False
            except Exception as exc:  # no JetStream yet, or the store stalled: later
                if not self._said_unreachable:
                    self._said_unreachable = True
                    self.log.warning("body_quota_store_unreachable", error=type(exc).__name__)
            await asyncio.sleep(RETRY_S)
            if time.monotonic() - swept >= SWEEP_S:
                swept = time.monotonic()
                self._sweep()

    async def _subscribe(self, info: api.StreamInfo) -> None:
        """Follow the stream ``info`` names from its first message, anew."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for _, task in list(self._checks.values()):
            task.cancel()
        self.tallies.clear()
        self.tenants.clear()
        self._heard = 0
        self._created = info.created
        self._sub = await self.nc.jetstream().subscribe(
            subjects.bodies_wildcard(),
            stream=subjects.BODIES_STREAM,
            cb=self._on_msg,
            ordered_consumer=True,
            headers_only=True,
            deliver_policy=api.DeliverPolicy.ALL,
        )

    def _sweep(self) -> None:
        """Forget chunks past the age limit, and keys that hold none."""
        before = time.time() - self.ttl_s
        for owner, tally in list(self.tallies.items()):
            tally.expire(before)
            if not tally.chunks and owner not in self._checks:
                del self.tallies[owner]
        for tenant, names in list(self.tenants.items()):
            names &= self.tallies.keys()
            if not names:
                del self.tenants[tenant]

    async def _on_msg(self, msg: Msg) -> None:
        meta = msg.metadata
        seq = meta.sequence.stream
        self._heard = max(self._heard, seq)
        parts = subjects.body_subject_parts(msg.subject)
        if parts is not None:
            self._count(parts, seq, meta.timestamp.timestamp(), msg)
        self._say_heard()

    def _count(self, parts: tuple[str, str, str], seq: int, at: float, msg: Msg) -> None:
        owner, object_id, rest = parts
        tally = self.tallies.setdefault(owner, Tally())
        if rest == subjects.BODY_DONE and tally.holds(object_id):
            # The key is done with an object it wrote: delete it (the marker with it, which a
            # count of the stream may hold already). With the queue full the marker counts as
            # any message, and the object until it expires.
            with contextlib.suppress(asyncio.QueueFull):
                self._deletes.put_nowait((owner, object_id))
                tally.drop_object(object_id)
                return
        tally.add(Chunk(seq, at, object_id, charge(msg)))
        tally.expire(time.time() - self.ttl_s)
        self._check_if_over(owner, seq)

    def _check_if_over(self, owner: str, seq: int) -> None:
        tally = self.tallies.get(owner)
        key_id = owner.partition(".")[2]
        most = self.quota(key_id)
        if tally is not None and most and tally.total > most and owner not in self._checks:
            task = asyncio.get_running_loop().create_task(self._check(owner, key_id))
            self._checks[owner] = (seq, task)
        tenant = self.tenant(key_id)
        if tenant and tally is not None:
            self.tenants.setdefault(tenant, set()).add(owner)
            self._check_tenant_if_over(tenant, seq)

    def _check_tenant_if_over(self, tenant: str, seq: int) -> None:
        if not self.owner_max or f"tenant:{tenant}" in self._checks:
            return
        names = self.tenants.get(tenant, set())
        if sum(self.tallies[n].total for n in names if n in self.tallies) > self.owner_max:
            task = asyncio.get_running_loop().create_task(self._check_tenant(tenant))
            self._checks[f"tenant:{tenant}"] = (seq, task)

    async def _check_tenant(self, tenant: str) -> None:
        """Count what every key of ``tenant`` holds from the stream itself; while the keys
        together hold more than :attr:`owner_max`, purge the bodies of the one holding the
        most (each purge bounded by its count's sequence, as a key's own)."""
        checked = False
        try:
            before = (await self.nc.jetstream().stream_info(subjects.BODIES_STREAM)).state
            counts = []
            for owner in sorted(self.tenants.get(tenant, set())):
                key_id = owner.partition(".")[2]
                counted, last, _ = await self._recount(key_id, 0)  # whole: most 0
                floor = max(before.last_seq, last)
                self.tallies.setdefault(owner, Tally()).replace(counted, floor)
                counts.append((sum(c.charge for c in counted), owner, key_id, floor))
            total = sum(held for held, *_ in counts)
            for held, owner, key_id, floor in sorted(counts, reverse=True):
                if total <= self.owner_max or not held:
                    break
                purged = await bodies.purge(self.nc, subjects.key_bodies(key_id), below=floor + 1)
                self.tallies.setdefault(owner, Tally()).cut(floor)
                total -= held
                if purged:
                    await self._purged(key_id, held, self.owner_max, purged, tenant=tenant)
            checked = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the store stalled: the tenant's next chunk checks again
            self.log.warning("body_quota_check_failed", owner=tenant, error=type(exc).__name__)
        finally:
            self._checks.pop(f"tenant:{tenant}", None)
            self._say_heard()
        if checked:  # more written meanwhile
            self._check_tenant_if_over(tenant, self._heard)

    async def _check(self, owner: str, key_id: str) -> None:
        """Count what ``owner`` holds from the stream itself; purge it all if over its quota."""
        checked = False
        try:
            most = self.quota(key_id)
            before = (await self.nc.jetstream().stream_info(subjects.BODIES_STREAM)).state
            counted, last, whole = await self._recount(key_id, most)
            # Every chunk of the key up to ``floor`` is in ``counted``: those to ``before``
            # existed when the count began; a partial count stops at its last chunk.
            floor = max(before.last_seq, last) if whole else last
            tally = self.tallies.setdefault(owner, Tally())
            tally.replace(counted, floor)
            held = sum(c.charge for c in counted)
            if most and held > most:
                purged = await bodies.purge(self.nc, subjects.key_bodies(key_id), below=floor + 1)
                tally.cut(floor)
                if purged:
                    await self._purged(key_id, held, most, purged)
            checked = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the store stalled: the next chunk of the key checks again
            self.log.warning("body_quota_check_failed", key_id=key_id, error=type(exc).__name__)
        finally:
            self._checks.pop(owner, None)
            self._say_heard()
        if checked:  # more written meanwhile (after a failure: the key's next chunk)
            self._check_if_over(owner, self._heard)

    async def _recount(self, key_id: str, most: int) -> tuple[list[Chunk], int, bool]:
        """The key's chunks in the stream now (headers only), the last one's sequence, and
        whether the count is whole: it stops once past ``most``, as that is enough to
        decide (a key writing as fast as it is read would keep a whole count going)."""
        js = self.nc.jetstream()
        config = api.ConsumerConfig(
            headers_only=True,
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=60.0,  # removed by the server if this process dies mid-count
        )
        psub = await js.pull_subscribe(
            subjects.key_bodies(key_id), stream=subjects.BODIES_STREAM, config=config
        )
        counted: list[Chunk] = []
        last, held, name = 0, 0, None
        try:
            info = await psub.consumer_info()
            name, pending = info.name, info.num_pending or 0
            while pending > 0:
                if most and held > most:
                    return counted, last, False
                got = await psub.fetch(min(pending, RECOUNT_BATCH), timeout=bodies.OP_TIMEOUT_S)
                for m in got:
                    meta = m.metadata
                    parts = subjects.body_subject_parts(m.subject)
                    oid = parts[1] if parts is not None else ""
                    c = Chunk(meta.sequence.stream, meta.timestamp.timestamp(), oid, charge(m))
                    counted.append(c)
                    held += c.charge
                    last, pending = c.seq, meta.num_pending or 0
            return counted, last, True
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
            if name is not None:
                with contextlib.suppress(Exception):
                    await js.delete_consumer(subjects.BODIES_STREAM, name)

    async def _purged(
        self, key_id: str, held: int, most: int, chunks: int, *, tenant: str = ""
    ) -> None:
        """Said once per purge that removed something: a log line, the counters, and the
        notice readers turn into a 429 naming the quota (the key's, or with ``tenant`` its
        owner's)."""
        PURGES.inc()
        PURGED.inc(chunks)
        scope = "owner" if tenant else "key"
        self.log.warning(
            "body_quota_purged",
            key_id=key_id,
            held_bytes=held,
            quota=most,
            chunks=chunks,
            scope=scope,
            **({"owner": tenant} if tenant else {}),
        )
        with contextlib.suppress(Exception):  # without it a reader answers the plain 400
            await self.nc.jetstream().publish(
                subjects.body_quota_notice(key_id),
                json.dumps({"quota": most, "scope": scope, "at": time.time()}).encode(),
                timeout=bodies.OP_TIMEOUT_S,
            )

    async def _deleter(self) -> None:
        while True:
            owner, object_id = await self._deletes.get()
            try:
                if await bodies.purge(self.nc, subjects.body_object(owner, object_id)):
                    DELETED.inc()
            except Exception as exc:  # the age limit removes it (and it counts till then)
                self.log.warning("body_done_delete_failed", error=type(exc).__name__)

    def _say_heard(self) -> None:
        """The sequence up to which every chunk is accounted for (checks in flight hold it
        back to just before the chunk that started them)."""
        pending = [seq for seq, _ in self._checks.values()]
        HEARD.set(min([self._heard, *(s - 1 for s in pending)]))

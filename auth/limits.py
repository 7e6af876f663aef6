"""Distributed rate limits: requests/minute, tokens/minute and concurrent requests per key,
held exactly across any number of limiter instances.

The shared state: counters in a JetStream KV bucket (memory storage, entries expire after
a few minutes), changed only by compare-and-set on the entry's revision. Two instances that
race on one key both read revision n; one writes n+1, the other's write is refused and it
retries on the new value. So the limit holds for the key across all instances (not limit
times instances), and a limiter restart loses nothing: the state lives in the NATS server.

The request path mostly does not touch the store: an instance *leases* part of a key's
allowance (requests and tokens of the current window, concurrency slots) with one
compare-and-set and admits locally from the lease until it runs out. Everything admitted
was leased from the shared counter first, so the limit is never exceeded. Beyond what the
request needs, a lease takes at most a sixteenth of what is left (so near a limit it is
exactly what one request needs, and the limit is reached exactly), and it grows while a
key is busy (1, 2, 4, ... requests) so a hot key costs one store round trip per many
requests instead of one per request; a busy key far from its limit is leased ahead, in
the background, before the lease runs out.

* RPM and TPM use fixed one-minute windows (``rl.<key>.<minute>``: what has been leased).
  Never more than the limit is admitted in a window; what an instance leased and did not
  use when the window ends is lost (at most a sixteenth of what was left, per instance).
* TPM is reserved at admission (prompt estimate + max_tokens) and reconciled with the real
  usage the worker reports when the request ends. Unused tokens go back to this instance's
  lease while the key is far from its limit (no store write: the shared counter already
  holds them as leased, and the next requests admit from them), to the shared counter
  near it (so other instances can use them); a request that used more than it reserved
  is charged from the lease when it covers the excess, else in the store.
* A request moved to another replica (migration) is admitted again without counting a
  request, on proof that it was admitted before (:mod:`auth.ratelimit`'s admission ticket);
  the attempt it replaces is then charged only the output the caller got from it, so the
  request counts once in RPM and its tokens once in TPM (``settle`` per attempt).
* Concurrency slots (``cc.<key>``: slots held per limiter instance, each with an expiry the
  instance renews while it holds them). A request's slot is freed when its usage report
  comes back (to the instance that admitted it) or at its deadline; slots an instance no
  longer needs go back at once; a limiter that dies loses its slots after ``LEASE_TTL_S``.

Failure behaviour: when the KV store cannot be reached the limiter fails open (admits and
logs) or closed (503), per ``ratelimit.fail_open``. With ``ratelimit.cut_off_share`` above 0
(a site's bridge, whose store is across a link that may be cut: docs/deploy.md, "Sites"), a
lease the store has not granted in ``ratelimit.cut_off_after_s`` is taken locally instead,
from at most that share of each limit per window (at least one request, one slot); for
:data:`CUT_OFF_PROBE_S` after, the store is not asked at all. What was admitted so goes
into the shared counter with this instance's next lease of the window (the drift: at most
the share, per window and per cut-off limiter); local concurrency slots go into the store
with the instance's next write of its slots. Counts may end up over, never under.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.js.api import StorageType
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter

from auth.cut_off_state import CutOffState
from bus_schemas import errors as E
from services import buckets

BUCKET = "tokenbus_ratelimit"
# Long-lived secrets of the limiters (no TTL): the key admission tickets are signed with.
SECRETS_BUCKET = "tokenbus_secrets"
_ATTEMPTS_KEPT = 50_000  # admitted attempts remembered (reports, duplicates, supersedes)
WINDOW_S = 60
_MAX_CAS_TRIES = 100
_MAX_CHUNK = 1024  # requests one lease may cover
_SHARE = 16  # a lease takes at most this fraction of what is left beyond its own need
LEASE_TTL_S = 10.0  # concurrency slots of an instance that stops renewing them expire
# After a lease the store did not grant in time (cut-off mode), this long without asking it.
CUT_OFF_PROBE_S = 5.0
CUT_OFF_ADMITTED = Counter(
    "tokenbus_ratelimit_cut_off_admitted_total",
    "Leases a limiter took from its share of a key's limits while its store was out of reach "
    "(ratelimit.cut_off_share: a site cut off from the hub), by kind (window: requests and "
    "tokens a minute; slot: a concurrent request)",
    ["kind"],
)


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


@dataclass
class _Window:
    """This instance's lease on one key's current window."""

    window: int
    r_left: int = 0  # leased and not yet used
    t_left: int = 0
    r_seen: int = 0  # the shared counters after this instance's last lease
    t_seen: int = 0
    chunk: int = 1  # requests the next lease asks for beyond what is needed
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    prefetching: bool = False
    tpm: int | None = None  # the key's limit when it was last admitted
    # Admitted locally while the store was out of reach (cut-off mode): in all this window,
    # and not yet written into the shared counter.
    local_r: int = 0
    local_t: int = 0
    owed_r: int = 0
    owed_t: int = 0

    def settles(self, delta: int) -> bool:
        """Whether a change of ``delta`` tokens to an attempt's charge can be made in the
        lease instead of the store: an excess the lease covers (leased tokens are counted
        in the store already), or a refund that leaves the lease no bigger than a lease may
        grow to (about a fifteenth of what the store had left at the last lease)."""
        if delta > 0:
            return self.t_left >= delta
        return self.tpm is not None and (self.t_left - delta) * (_SHARE - 1) <= (
            self.tpm - self.t_seen
        )


@dataclass(slots=True)
class _Attempt:
    """One attempt of a request this instance admitted: what the window was charged for it,
    what it holds, and what is known of its use."""

    window: int
    charged: int  # tokens the window counts for this attempt now
    at: float  # admitted (or last found still running), for forgetting it
    deadline: float  # the request's deadline (s): it cannot be running after this
    windowed: bool  # counted in the key's RPM/TPM window
    slot: bool  # holds a concurrency slot
    reported: bool = False
    prompt: int = 0
    completion: int = 0
    resumed: int | None = None  # superseded by a migration: output the caller got from it

    def charge(self) -> int:
        """A superseded attempt costs the output it delivered (the next attempt counts the
        prompt again); any other costs what its worker reported."""
        if self.resumed is not None:
            return max(self.resumed, self.completion)
        return self.prompt + self.completion


@dataclass
class _Slots:
    """Concurrency slots this instance holds for one key."""

    held: int = 0
    in_use: dict[str, float] = field(default_factory=dict)  # request id -> deadline (s)
    keep: int = 0  # spare slots worth keeping (0 near the limit)
    chunk: int = 1
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Limiter:
    """RPM, TPM and concurrency per principal over a shared KV bucket, leased per instance."""

    def __init__(
        self,
        nc: NATS,
        bucket: str = BUCKET,
        owner: str | None = None,
        lease_ttl_s: float = LEASE_TTL_S,
        cut_off_share: float = 0.0,
        cut_off_after_s: float = 2.0,
        state: CutOffState | None = None,
    ) -> None:
        self.nc = nc
        # What was admitted while cut off, on local disk until written (ratelimit.cut_off_dir).
        self.state = state
        self.lease_ttl_s = lease_ttl_s
        # Cut-off mode (the module's doc): 0 is off, the store's answer is waited for.
        self.cut_off_share = cut_off_share
        self.cut_off_after_s = cut_off_after_s
        self._out_until = 0.0  # the store is not asked before then (monotonic)
        self.bucket = bucket
        # Names this instance in the store and in usage reports (``subjects.usage(owner)``).
        self.owner = owner or uuid.uuid4().hex[:12]
        self.kv: KeyValue | None = None
        self._writes = buckets.Grouped(self._kv, tries=_MAX_CAS_TRIES, refusals=(E.TokenbusError,))
        self._windows: dict[str, _Window] = {}
        self._slots: dict[str, _Slots] = {}
        self._limits: dict[str, int] = {}  # principal -> its concurrency limit, for renewals
        self._tasks: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._attempts: OrderedDict[tuple[str, str, int], _Attempt] = OrderedDict()
        self.secret = b""  # shared by every limiter of the bus (admission tickets)

    async def open(self) -> Limiter:
        js = self.nc.jetstream()
        self.kv = await buckets.open_kv(
            js, self.bucket, ttl=3 * WINDOW_S, storage=StorageType.MEMORY
        )
        self.secret = await self._shared_secret(js)
        self._restore()
        self._renewer = asyncio.create_task(self._renew_forever())
        return self

    def _restore(self) -> None:
        """The windows a gone limiter admitted locally in and had not written (its state
        file, taken over): this window's are owed by this one now, past ones are moot."""
        if self.state is None:
            return
        window = int(time.time() // WINDOW_S)
        for principal, (at, local_r, local_t, owed_r, owed_t) in list(self.state.windows.items()):
            if at != window:
                del self.state.windows[principal]
                continue
            self._windows[principal] = _Window(
                at, local_r=local_r, local_t=local_t, owed_r=owed_r, owed_t=owed_t
            )
        self.state.save()

    def _note(self, principal: str, w: _Window) -> None:
        """``w``'s local admissions as the state file keeps them (while any is owed)."""
        if self.state is None:
            return
        if w.owed_r or w.owed_t:
            self.state.windows[principal] = [w.window, w.local_r, w.local_t, w.owed_r, w.owed_t]
        else:
            self.state.windows.pop(principal, None)
        self.state.save_soon()

    @staticmethod
    async def _shared_secret(js: Any) -> bytes:
        """The limiters' signing key: made by the first limiter, read by the others."""
        kv = await buckets.open_kv(js, SECRETS_BUCKET)
        # Through a bucket just made on a cluster (its stream electing a leader: reads and
        # writes time out for a moment) as through a stall.
        with contextlib.suppress(KeyWrongLastSequenceError):  # another limiter made it
            await buckets.create(kv, "admission", secrets.token_bytes(32))
        entry = await buckets.through_stall(lambda: kv.get("admission"), what=SECRETS_BUCKET)
        return bytes(entry.value or b"")

    async def claim(self, name: str) -> bool:
        """True the first time ``name`` is claimed by any limiter within a few windows."""
        try:
            # Through a stalled stream leader too; a value of its own, so that a claim
            # whose answer was lost is told from another limiter's (services.buckets.create).
            await buckets.create(self._kv(), f"once.{name}", uuid.uuid4().hex.encode())
        except KeyWrongLastSequenceError:
            return False
        return True

    async def close(self) -> None:
        """Give back the concurrency slots this instance holds (best effort)."""
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
        for task in list(self._tasks):
            task.cancel()
        for principal, slots in list(self._slots.items()):
            if slots.held:
                slots.in_use.clear()
                with contextlib.suppress(Exception):
                    await self._set_slots(principal, slots, 0)
        if self.state is not None:
            self.state.close()  # left for the next process while anything is owed

    def _kv(self) -> KeyValue:
        if self.kv is None:
            raise RuntimeError("Limiter.open() first")
        return self.kv

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cas(
        self, key: str, change: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> dict[str, Any]:
        """Apply ``change`` to the entry at ``key`` atomically: the state after it. A change
        that refuses (``TokenbusError``) raises to its caller alone. Changes to one key from
        this instance go together (services.buckets.Grouped): a hot key costs one KV round
        trip per group, and at most one writer per limiter instance races on it."""
        return (await self._writes.apply(key, change))[1]

    # --- requests and tokens per window ----------------------------------------------------

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
        requests: int = 1,
        attempt: int = 0,
    ) -> Admission:
        """Count the request against every limit of ``principal`` or raise RateLimited.
        ``requests=0``: a migrated request, already counted (its tokens are reserved).
        ``attempt``: which attempt of the request this is (the one its report will name)."""
        now = time.time()
        window = int(now // WINDOW_S)
        reset = (window + 1) * WINDOW_S - now
        info: dict[str, str] = {}
        need_t = tokens if tpm is not None else 0
        if rpm is not None or tpm is not None:
            w = self._windows.get(principal)
            if w is None or w.window != window:
                w = self._windows[principal] = _Window(window)
            w.tpm = tpm
            if w.r_left < requests or w.t_left < need_t:
                async with w.lock:  # one lease at a time per key; the others wait and reuse it
                    # A lease takes only what the lease lacks; requests admitted from it
                    # while it was in flight can leave it short again: lease once more.
                    while w.r_left < requests or w.t_left < need_t:
                        lease = self._lease(principal, w, rpm, tpm, need_t, reset, need_r=requests)
                        if not await self.in_reach(lease):
                            self._lease_locally(w, rpm, tpm, need_t, reset, requests)
                            self._note(principal, w)
            w.r_left -= requests
            w.t_left -= need_t
            if rpm is not None:
                info.update(self._trio("requests", rpm, rpm - (w.r_seen - w.r_left), reset))
            if tpm is not None:
                info.update(self._trio("tokens", tpm, tpm - (w.t_seen - w.t_left), reset))
            if self._worth_prefetching(w, rpm, tpm, need_t):
                w.prefetching = True
                self._spawn(self._prefetch(principal, w, rpm, tpm, need_t, reset))
        if concurrent is not None:
            try:
                await self._take_slot(principal, request_id, concurrent, deadline_s, info)
            except E.RateLimited:
                self._refund(principal, window, requests, need_t)
                raise
        windowed = rpm is not None or tpm is not None
        a = _Attempt(window, need_t, now, deadline_s, windowed, concurrent is not None)
        self._remember((principal, request_id, attempt), a, now)
        return Admission(window, tokens, info)

    def _remember(self, key: tuple[str, str, int], a: _Attempt, now: float) -> None:
        """Keep an admitted attempt until its report and any supersede can have come: a
        few windows, and longer while it may still be running (its report frees its slot).
        Past ``_ATTEMPTS_KEPT`` the oldest is forgotten whatever it is."""
        kept = self._attempts
        kept.pop(key, None)  # admitted again (a replayed request id): the newest counts
        kept[key] = a
        old = now - 3 * WINDOW_S
        while kept:
            first = next(iter(kept.values()))
            if len(kept) <= _ATTEMPTS_KEPT and first.at >= old:
                return
            k, first = kept.popitem(last=False)
            if len(kept) < _ATTEMPTS_KEPT and not first.reported and first.deadline > now:
                first.at = now  # still running: keep it, looked at again in a few windows
                kept[k] = first

    async def _lease(
        self,
        principal: str,
        w: _Window,
        rpm: int | None,
        tpm: int | None,
        need_t: int,
        reset: float,
        *,
        need_r: int = 1,
    ) -> None:
        chunk = w.chunk
        grant: list[int] = [0, 0]
        # What was admitted locally (cut-off mode) goes into the counter with this lease.
        owed_r, owed_t = w.owed_r, w.owed_t

        def take(cur: dict[str, Any]) -> dict[str, Any]:
            r, t = int(cur.get("r", 0)) + owed_r, int(cur.get("t", 0)) + owed_t
            # What the request needs beyond what the lease still holds (tokens given back
            # to it by earlier requests included); a lease ahead (need_r 0) takes need_t.
            short_r = max(0, need_r - w.r_left)
            short_t = max(0, need_t - w.t_left) if need_r else need_t
            if rpm is not None and r + short_r > rpm:
                raise self._limited("requests", rpm, 0, reset, tpm, t)
            if tpm is not None and t + short_t > tpm:
                raise self._limited(
                    "tokens", tpm, max(0, tpm - t), reset, tpm, t, rpm=rpm, used_r=r
                )
            # Beyond what is needed: the chunk, at most a sixteenth of what is left.
            extra = chunk - 1 if need_r else chunk
            if rpm is not None:
                extra = min(extra, (rpm - r - short_r) // _SHARE)
            extra_t = need_t * extra if need_r else need_t * chunk
            if tpm is not None:
                extra_t = min(extra_t, (tpm - t - short_t) // _SHARE)
                if need_t:  # tokens for each extra request, or no extra requests
                    extra = min(extra, extra_t // need_t)
            grant[0], grant[1] = short_r + extra, short_t + max(0, extra_t)
            return {"r": r + grant[0], "t": t + grant[1]}

        new = await self._cas(f"rl.{principal}.{w.window}", take)
        w.owed_r -= owed_r
        w.owed_t -= owed_t
        if owed_r or owed_t:
            self._note(principal, w)
        w.r_left += grant[0]
        w.t_left += grant[1]
        w.r_seen, w.t_seen = int(new["r"]), int(new["t"])
        w.chunk = min(chunk * 2, _MAX_CHUNK)

    async def in_reach(self, call: Any) -> bool:
        """Await ``call`` (a write to the store); in cut-off mode, False when the store did
        not answer in ``cut_off_after_s`` or could not be reached, or has not been asked
        since it last did not (``call`` then not awaited). A refusal (a limit) raises."""
        if not self.cut_off_share:
            await call
            return True
        if time.monotonic() < self._out_until:
            call.close()
            return False
        try:
            await asyncio.wait_for(call, self.cut_off_after_s)
            return True
        except E.TokenbusError as exc:
            if not isinstance(exc, E.ServiceUnavailable):
                raise
        except (TimeoutError, OSError, nats.errors.Error):
            pass
        self._out_until = time.monotonic() + CUT_OFF_PROBE_S
        return False

    def _lease_locally(
        self,
        w: _Window,
        rpm: int | None,
        tpm: int | None,
        need_t: int,
        reset: float,
        need_r: int,
    ) -> None:
        """What a request needs beyond the lease, admitted locally (cut-off mode) within the
        share of each limit for this window, or RateLimited."""
        short_r, short_t = max(0, need_r - w.r_left), max(0, need_t - w.t_left)
        over = [
            f"{cap} {per}"
            for limit, used, short, per in (
                (rpm, w.local_r, short_r, "requests"),
                (tpm, w.local_t, short_t, "tokens"),
            )
            if limit is not None and used + short > (cap := max(1, int(limit * self.cut_off_share)))
        ]
        if over:
            raise E.RateLimited(
                "the rate limiter cannot reach its store (this site is cut off) and this "
                f"key's share of its limits while so ({', '.join(over)} a minute) is used; "
                f"retry in {math.ceil(reset)} s",
                headers={"Retry-After": str(math.ceil(reset))},
            )
        w.local_r += short_r
        w.local_t += short_t
        w.owed_r += short_r
        w.owed_t += short_t
        w.r_left += short_r
        w.t_left += short_t
        CUT_OFF_ADMITTED.labels("window").inc()

    def _worth_prefetching(self, w: _Window, rpm: int | None, tpm: int | None, need_t: int) -> bool:
        """Lease ahead only for a busy key far from its limits (nothing is stranded then)."""
        if w.prefetching or w.chunk <= 2 or w.r_left > w.chunk // 4:
            return False
        far_r = rpm is None or rpm - w.r_seen >= 16 * w.chunk
        far_t = tpm is None or tpm - w.t_seen >= 16 * w.chunk * max(1, need_t)
        return far_r and far_t

    async def _prefetch(
        self,
        principal: str,
        w: _Window,
        rpm: int | None,
        tpm: int | None,
        need_t: int,
        reset: float,
    ) -> None:
        try:
            # A failed lease ahead is simply retried on the request path later.
            with contextlib.suppress(Exception):
                async with w.lock:
                    if w.window == int(time.time() // WINDOW_S):
                        await self._lease(principal, w, rpm, tpm, need_t, reset, need_r=0)
        finally:
            w.prefetching = False

    def _refund(self, principal: str, window: int, requests: int, tokens: int) -> None:
        """Give an admitted-then-refused request's allowance back to the local lease."""
        w = self._windows.get(principal)
        if w is not None and w.window == window:
            w.r_left += requests
            w.t_left += tokens

    # --- concurrency ---------------------------------------------------------------------

    async def _take_slot(
        self,
        principal: str,
        request_id: str,
        limit: int,
        deadline_s: float,
        info: dict[str, str],
    ) -> None:
        slots = self._slots.setdefault(principal, _Slots())
        self._limits[principal] = limit
        if len(slots.in_use) >= slots.held:
            async with slots.lock:
                if len(slots.in_use) >= slots.held and not await self.in_reach(
                    self._grow_slots(principal, slots, limit, info)
                ):
                    # Cut off: a slot of this key's share, in the store with the next write.
                    cap = max(1, int(limit * self.cut_off_share))
                    if len(slots.in_use) + 1 > cap:
                        raise E.RateLimited(
                            "the rate limiter cannot reach its store (this site is cut off) "
                            f"and this key's share of its concurrency limit while so ({cap}) "
                            "is in use; retry when one finishes",
                            headers={"Retry-After": "1", **info},
                        )
                    CUT_OFF_ADMITTED.labels("slot").inc()
        slots.in_use[request_id] = deadline_s

    async def _grow_slots(
        self, principal: str, slots: _Slots, limit: int, info: dict[str, str]
    ) -> None:
        now = time.time()
        me = self.owner
        chunk = slots.chunk
        got: list[int] = [0, 0]

        def take(cur: dict[str, Any]) -> dict[str, Any]:
            live = {k: v for k, v in cur.items() if float(v[1]) > now}
            others = sum(int(v[0]) for k, v in live.items() if k != me)
            mine = len(slots.in_use) + 1
            if others + mine > limit:
                raise E.RateLimited(
                    f"too many concurrent requests for this key (limit {limit}); "
                    "retry when one finishes",
                    headers={"Retry-After": "1", **info},
                )
            spare = min(chunk - 1, (limit - others - mine) // _SHARE)
            live[me] = [mine + spare, now + self.lease_ttl_s]
            got[0], got[1] = mine + spare, spare
            return live

        await self._cas(f"cc.{principal}", take)
        slots.held, slots.keep = got
        slots.chunk = min(chunk * 2, _MAX_CHUNK)

    async def _set_slots(self, principal: str, slots: _Slots, held: int) -> None:
        now = time.time()
        me = self.owner

        def put(cur: dict[str, Any]) -> dict[str, Any]:
            live = {k: v for k, v in cur.items() if float(v[1]) > now}
            if held > 0:
                live[me] = [held, now + self.lease_ttl_s]
            else:
                live.pop(me, None)
            return live

        await self._cas(f"cc.{principal}", put)
        slots.held = held

    async def _release_slot(self, principal: str, request_id: str) -> None:
        slots = self._slots.get(principal)
        if slots is None or slots.in_use.pop(request_id, None) is None:
            return
        if slots.held - len(slots.in_use) > slots.keep:
            # More spare slots than are worth keeping (all of them, near the limit): give
            # them back now so other instances can use them.
            async with slots.lock:
                target = len(slots.in_use) + slots.keep
                if slots.held > target:
                    await self._set_slots(principal, slots, target)

    async def _renew_forever(self) -> None:
        """Keep held slots alive; drop requests past their deadline (their worker died)."""
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            now = time.time()
            for principal, slots in list(self._slots.items()):
                for rid, deadline in list(slots.in_use.items()):
                    if deadline < now:
                        slots.in_use.pop(rid, None)
                if not slots.held:
                    if not slots.in_use:
                        self._slots.pop(principal, None)
                    continue
                held = len(slots.in_use) + (slots.keep if slots.in_use else 0)
                with contextlib.suppress(Exception):  # retried at the next renewal
                    async with slots.lock:
                        await self._set_slots(principal, slots, held)
            for principal, w in list(self._windows.items()):
                if w.window < int(now // WINDOW_S):
                    self._windows.pop(principal, None)

    # --- after the request -----------------------------------------------------------------

    async def settle(
        self,
        principal: str,
        request_id: str,
        used: int = 0,
        *,
        attempt: int = 0,
        prompt: int | None = None,
        completion: int | None = None,
        resumed: int | None = None,
    ) -> bool:
        """Reconcile an attempt's reservation with what it really used and free its
        concurrency slot (the worker's report: ``used``, or ``prompt`` + ``completion``);
        or, with ``resumed``, mark the attempt superseded by a migration that delivered
        that much of its output. Each arrives once per attempt, in either order.

        Only attempts this instance admitted are settled, by what it recorded when it
        admitted them (window, reservation, slot): a report of any other (forged, or for
        another instance, or from before a restart) changes nothing and returns False."""
        a = self._attempts.get((principal, request_id, attempt))
        if a is None:
            return False
        if resumed is None:
            if a.reported:
                return True  # a duplicate report
            a.reported = True
            a.prompt, a.completion = (used, 0) if prompt is None else (prompt, completion or 0)
            if a.slot:
                await self._release_slot(principal, request_id)
        else:
            if a.resumed is not None:
                return True
            a.resumed = max(0, resumed)
        delta = a.charge() - a.charged  # reported or superseded by now: its charge is known
        if not a.windowed or not delta:
            return True
        a.charged += delta

        def adjust(cur: dict[str, Any]) -> dict[str, Any]:
            return {"r": int(cur.get("r", 0)), "t": max(0, int(cur.get("t", 0)) + delta)}

        w = self._windows.get(principal)
        if w is not None and w.window == a.window and w.settles(delta):
            w.t_left -= delta
            return True
        await self._cas(f"rl.{principal}.{a.window}", adjust)
        if w is not None and w.window == a.window:
            w.t_seen = max(0, w.t_seen + delta)
        return True

    def awaiting_report(self) -> int:
        """Attempts admitted here whose worker has not reported their usage yet."""
        return sum(1 for a in self._attempts.values() if not a.reported and a.resumed is None)

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

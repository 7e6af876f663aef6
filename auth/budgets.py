"""Spend budgets per key and per owner, held exactly across limiter instances.

A model's price (``router.price`` / ``router.models.<m>.price``: dollars per million input,
cached input and output tokens) turns what the engine reports into spend, on the same path
as TPM: the ratelimit stage *reserves* a request's most likely cost when it admits it (the
prompt estimate, plus ``max_tokens`` or, for a request that set none, the TPM default
reserve) and *settles* it with the worker's usage report when it ends.

A budget has a period (``day`` and ``month`` in UTC, or ``total``) and two thresholds: a
request whose reservation would take the key's (or its owner's) spend plus what is held
for requests in flight past the *hard* one is refused with 429 ``insufficient_quota``
(OpenAI's code); crossing the *soft* one raises an alert (a log line, an event on the bus
the telemetry service exports as ``tokenbus_budget_soft_exceeded``, an alert rule).

State lives in a JetStream KV bucket (file storage: spend outlives restarts), one entry
per scope and period (``k.<key id>.<period>``, ``o.<owner>.<period>``): what was spent and
what is held per request in flight (with the request's deadline, so a limiter that dies
holding some does not keep them past it). Every change is a compare-and-set on the entry's
revision, so two bridges or limiters never both take the last dollar. Owner budgets are
entries ``b.<owner>`` of the same bucket (``tokenbus keys owner-budget``, the admin API).
Money is counted in micro-dollars (integers): a token priced at $X per million costs X
micro-dollars.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import StorageType
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from auth.cut_off_state import CutOffState
from bus_schemas import codec, subjects
from bus_schemas import errors as E
from services import audit, buckets
from services.config import PriceSettings

BUCKET = "tokenbus_spend"
PERIODS = ("day", "month", "total")
_MAX_CAS_TRIES = 100
_OWNER_TTL_S = 5.0  # how long an owner's budget is cached by a limiter
_SETTLED_KEPT = 100_000  # holds a book remembers settling (their reports come twice)
# What a worker's report charged is noted beside the entry this long (at most until the
# request's deadline), for a supersede that comes after it, and at most this many per entry.
CHARGE_NOTE_S = 120.0
CHARGE_NOTES_KEPT = 1024


def _notes_key(entry: str) -> str:
    """The entry beside ``entry`` that notes what reports charged (:meth:`SpendBook.settle`)."""
    return f"n.{entry}"


def _live_notes(cur: dict[str, Any], now: float) -> dict[str, list[Any]]:
    """The notes of an entry not yet due (their shapes: :data:`_PROVISIONAL`)."""
    return {
        k: v for k, v in cur.items() if isinstance(v, list) and len(v) >= 2 and float(v[1]) > now
    }


# A note's shape: ``[charged, due, 0, produced]`` a worker's report charged (``[charged,
# due, 0, produced, _UNREAD]`` the report of a copy its caller never read: a duplicate);
# ``[provisional, due, 1, _PROVISIONAL]`` a supersede charged its caller's word before the
# report came; ``[0, due, 1, _FINAL]`` corrected, nothing left to do.
_PROVISIONAL = "p"
_FINAL = "f"
_UNREAD = "d"
_DONE = object()  # _take_charge: superseded already

# How a book settled a hold (SpendBook._settled), by rank: a report of a higher rank is not
# settled again; a lower one does not stop a higher one.
_BY_SUPERSEDE, _BY_DUPLICATE, _BY_REPORT = 0, 1, 2


def _superseded(note: list[Any]) -> bool:
    return len(note) > 2 and note[2] == 1


def _unread(note: list[Any]) -> bool:
    """Whether the note is a duplicate's report's: a copy of the request run unread."""
    return len(note) > 4 and note[4] == _UNREAD and not _superseded(note)


def _note_name(hold_name: str) -> str:
    """A hold's name in the notes: its hash (a request id is the caller's, of any length)."""
    return hashlib.blake2b(hold_name.encode(), digest_size=8).hexdigest()


def micro(usd: float | None) -> int | None:
    """Dollars as micro-dollars (None stays None)."""
    return None if usd is None else round(usd * 1_000_000)


def cost(price: PriceSettings | None, prompt: int, completion: int, cached: int = 0) -> int:
    """Micro-dollars that ``prompt`` (``cached`` of them from the cache) and ``completion``
    tokens cost at ``price`` (rounded up: a budget is never undercounted)."""
    if price is None:
        return 0
    cached = min(max(0, cached), max(0, prompt))
    cached_price = price.input if price.cached_input is None else price.cached_input
    total = (prompt - cached) * price.input + cached * cached_price + completion * price.output
    return math.ceil(total - 1e-9) if total > 0 else 0


def period_id(period: str, now: float | None = None) -> str:
    """The period a moment falls in: ``d20261125``, ``m202611`` (UTC) or ``total``."""
    t = time.gmtime(time.time() if now is None else now)
    if period == "day":
        return time.strftime("d%Y%m%d", t)
    if period == "month":
        return time.strftime("m%Y%m", t)
    return "total"


@dataclass(frozen=True, slots=True)
class Budget:
    """One scope's budget: ``k.<key id>`` or ``o.<owner>``; thresholds in micro-dollars."""

    scope: str
    period: str
    hard: int | None
    soft: int | None
    name: str = ""  # for people: ``key:<id>`` or ``owner:<name>``

    def entry(self, now: float | None = None) -> str:
        return f"{self.scope}.{period_id(self.period, now)}"


def header(period: str, hard_usd: float | None, soft_usd: float | None, owner: str) -> str:
    """The ``Tb-Budget`` value auth sets for a key."""
    hard, soft = micro(hard_usd), micro(soft_usd)
    return f"{period},{'' if hard is None else hard},{'' if soft is None else soft},{owner}"


def parse_header(value: str | None) -> tuple[Budget | None, str]:
    """(the key's budget if it has one, its owner) from ``Tb-Budget``."""
    if not value:
        return None, ""
    period, hard, soft, owner = [*value.split(",", 3), "", "", ""][:4]
    if period not in PERIODS:
        return None, owner
    h = int(hard) if hard.isdigit() else None
    s = int(soft) if soft.isdigit() else None
    return (Budget("", period, h, s) if h is not None or s is not None else None), owner


def owner_token(owner: str) -> str:
    """An owner's name as one KV key token (its UTF-8 bytes in hex: any name fits)."""
    return owner.encode().hex()


@dataclass
class Hold:
    """A request's reservation: the entries it holds an amount in."""

    request_id: str
    amount: int
    budgets: list[tuple[Budget, str]] = field(default_factory=list)  # (budget, entry)


# A hold outlives its request's deadline by this much before it is dropped: a report that
# comes late (its limiter died and another settles it from the stream) still finds it. Past
# its deadline it no longer counts against the budget.
HOLD_GRACE_S = 120.0


def _kept(cur: dict[str, Any], now: float) -> dict[str, Any]:
    """The holds of an entry not yet dropped (deadline + :data:`HOLD_GRACE_S` ahead)."""
    return {
        k: v
        for k, v in (cur.get("held") or {}).items()
        if isinstance(v, list) and len(v) >= 2 and float(v[1]) + HOLD_GRACE_S > now
    }


# A hold dropped unsettled (its report did not come by its deadline and the grace) is kept
# this long as lapsed, at most LAPSED_MAX per entry (the newest): a report that comes later
# still (a site cut off from the hub for minutes, whose worker tried its report again until
# the link was back: telemetry/records.py) charges it then, once. Without it a late report
# found no hold and charged nothing, and holds are how a report is charged once, so it
# cannot simply charge without one.
LAPSED_KEEP_S = 6 * 3600.0
LAPSED_MAX = 256


def _lapsed(cur: dict[str, Any], now: float) -> dict[str, Any]:
    """The entry's lapsed holds after this change: those kept (``[amount, lapsed at]``,
    younger than :data:`LAPSED_KEEP_S`) and the holds of ``cur`` that lapse now."""
    out = {
        k: v
        for k, v in (cur.get("lapsed") or {}).items()
        if isinstance(v, list) and len(v) >= 2 and float(v[1]) + LAPSED_KEEP_S > now
    }
    for k, v in (cur.get("held") or {}).items():
        if isinstance(v, list) and len(v) >= 2 and float(v[1]) + HOLD_GRACE_S <= now:
            out[k] = [int(v[0]), round(now, 1)]
    if len(out) > LAPSED_MAX:
        out = dict(sorted(out.items(), key=lambda kv: float(kv[1][1]))[-LAPSED_MAX:])
    return out


def _entry(
    cur: dict[str, Any], now: float, forget: str | None = None, **changes: Any
) -> dict[str, Any]:
    """``cur`` with ``changes`` (its ``held`` among them) and its lapsed holds carried on,
    but for ``forget``'s (charged now, or a new hold under that id)."""
    lapsed = _lapsed(cur, now)
    lapsed.pop(forget or "", None)
    out = {**cur, **changes, "lapsed": lapsed}
    if not lapsed:
        del out["lapsed"]
    return out


def _lapsing(cur: dict[str, Any]) -> dict[str, Any]:
    """What of ``cur`` :func:`_entry` reads to carry its lapsed holds on."""
    return {k: cur[k] for k in ("held", "lapsed") if k in cur}


def _in_flight(held: dict[str, Any], now: float) -> int:
    """What ``held``'s live holds hold (each hold ``[amount, deadline, ...]``)."""
    return sum(int(v[0]) for v in held.values() if float(v[1]) > now)


def _copies(v: list[Any]) -> int:
    """How many admissions share hold ``v``: ``[amount, deadline]`` is one; ``[amount,
    deadline, copies, [duplicates reported]]`` where a request was admitted again under the
    same id (the bridge sends a request it got no accept for again, through its own stages)."""
    return int(v[2]) if len(v) > 2 else 1


class _Settled(Exception):
    """The entry holds nothing for this request: nothing to charge."""


class SpendBook:
    """Spend and holds per scope and period in the ``tokenbus_spend`` bucket."""

    def __init__(self, nc: NATS, log: Any = None) -> None:
        self.nc = nc
        self.log = log
        self.kv: KeyValue | None = None
        self._owners: dict[str, tuple[float, Budget | None]] = {}
        # The entries this book wrote last (buckets.cas: the next write skips the read), and
        # the holds it settled lately (their reports' copies from the stream cost nothing)
        # with what it charged for each (None: settled elsewhere, or nothing to correct).
        self._known: dict[str, tuple[dict[str, Any], int]] = {}
        self._writes = buckets.Grouped(self._kv, tries=_MAX_CAS_TRIES, known=self._known)
        # Holds this book settled, and how (_BY_*): by a supersede only, the attempt's own
        # report may still come and correct its price; by a duplicate's report, the report of
        # the copy its caller read may still come and correct it.
        self._settled: dict[tuple[str, str], int] = {}
        # The deadlines of the holds this book made (a charge's note lasts no longer).
        self._held_until: dict[tuple[str, str], float] = {}
        # Holds taken while the store was out of reach (cut-off mode: reserve_locally), not
        # yet written into it: hold name -> (budget, entry, amount, deadline) per budget.
        # (The budget is None in a hold taken over from a gone limiter's state file.)
        self.local: dict[str, list[tuple[Budget | None, str, int, float]]] = {}
        self.state: CutOffState | None = None  # ratelimit.cut_off_dir: the holds on disk

    def keep_locally_on(self, state: CutOffState) -> None:
        """Write the holds taken while cut off to ``state``'s file until they are in the
        store, and take over those a gone limiter's file had (auth/cut_off_state.py)."""
        self.state = state
        for name, items in state.holds.items():
            self.local.setdefault(name, [(None, e, int(a), float(d)) for e, a, d in items])

    def _note_local(self, name: str) -> None:
        """Hold ``name`` on disk as it is now (gone once it is in the store)."""
        if self.state is None:
            return
        items = self.local.get(name)
        if items is None:
            self.state.holds.pop(name, None)
        else:
            self.state.holds[name] = [[e, a, d] for _, e, a, d in items]
        self.state.save_soon()

    async def open(self) -> SpendBook:
        self.kv = await buckets.open_kv(
            self.nc.jetstream(),
            BUCKET,
            storage=StorageType.FILE,
            description="tokenbus spend per key and owner and period (auth.budgets)",
        )
        return self

    def _kv(self) -> KeyValue:
        if self.kv is None:
            raise RuntimeError("SpendBook.open() first")
        return self.kv

    async def _cas(self, key: str, change: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Apply ``change`` (which may raise) to the entry at ``key`` atomically: (before,
        after); committed together with the other changes to the entry that come while a
        write to it is in flight (services.buckets.Grouped), through a stalled stream leader
        too, never twice."""
        return await self._writes.apply(key, change)

    # -- owners' budgets -------------------------------------------------------------------
    async def owner_budget(self, owner: str) -> Budget | None:
        """The owner's budget (cached a few seconds per limiter)."""
        if not owner:
            return None
        now = time.monotonic()
        hit = self._owners.get(owner)
        if hit is not None and now - hit[0] < _OWNER_TTL_S:
            return hit[1]
        budget = None
        with contextlib.suppress(KeyNotFoundError):
            kv, key = self._kv(), f"b.{owner_token(owner)}"
            entry = await buckets.through_stall(lambda: kv.get(key), what=key)
            d = json.loads(entry.value or b"{}")
            if d:
                budget = Budget(
                    f"o.{owner_token(owner)}",
                    d["period"],
                    d.get("hard"),
                    d.get("soft"),
                    f"owner:{owner}",
                )
        self._owners[owner] = (now, budget)
        return budget

    async def owner_budgets(self) -> list[tuple[str, Budget]]:
        """Every owner that has a budget, by name, with it: one read per owner (the
        ``b.`` entries only, never the spend entries beside them)."""
        found: list[tuple[str, Budget]] = []
        for key in await buckets.keys(self._kv(), "b.*"):
            try:
                owner = bytes.fromhex(key[2:]).decode()
            except ValueError:  # not an entry this module wrote (UnicodeDecodeError too)
                continue
            self._owners.pop(owner, None)  # read now, not from the cache
            try:
                budget = await self.owner_budget(owner)
            except (ValueError, KeyError, TypeError):  # an entry this module did not write
                continue
            if budget is not None:  # a removed budget's key is listed until compacted
                found.append((owner, budget))
        return sorted(found, key=lambda ob: ob[0])

    async def set_owner_budget(
        self,
        owner: str,
        *,
        hard_usd: float | None,
        soft_usd: float | None,
        period: str,
        actor: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Set (or, with neither threshold, remove) an owner's budget; recorded in the audit
        trail as ``actor``'s change."""
        if period not in PERIODS:
            raise E.InvalidRequest(f"period: one of {', '.join(PERIODS)}", param="period")
        if not owner:
            raise E.InvalidRequest("owner: a name, not empty", param="owner")
        for name, usd in (("usd", hard_usd), ("soft_usd", soft_usd)):
            if usd is not None and not (0 <= usd < 1e12):
                raise E.InvalidRequest(f"{name}: dollars, 0 or more", param=name)
        key = f"b.{owner_token(owner)}"
        async with audit.change(
            self.nc, audit.BUDGET_CHANGED, f"owner:{owner}", actor, request_id=request_id
        ) as change:
            if hard_usd is None and soft_usd is None:
                with contextlib.suppress(KeyNotFoundError):
                    await self._kv().delete(key)
            else:
                body = {"period": period, "hard": micro(hard_usd), "soft": micro(soft_usd)}
                await self._kv().put(key, json.dumps(body).encode())
            change.details = {"period": period, "budget_usd": hard_usd, "soft_budget_usd": soft_usd}
        self._owners.pop(owner, None)

    async def spent(self, budget: Budget, now: float | None = None) -> tuple[int, int]:
        """(spent, held for requests in flight) in the budget's current period: never less
        than this book's own writes left (buckets.read)."""
        try:
            entry = await buckets.read(self._kv(), budget.entry(now), known=self._known)
        except KeyNotFoundError:
            return 0, 0
        d = json.loads(entry.value or b"{}")
        now = time.time() if now is None else now
        return int(d.get("spent", 0)), _in_flight(_kept(d, now), now)

    # -- the request path ------------------------------------------------------------------
    async def reserve(
        self, budgets: list[Budget], request_id: str, amount: int, deadline_s: float
    ) -> Hold:
        """Hold ``amount`` for the request in each budget's current period, or raise 429
        ``insufficient_quota`` (nothing held) when one would pass its hard threshold."""
        hold = Hold(request_id, amount)
        now = time.time()
        try:
            for b in budgets:
                entry = b.entry(now)

                def take(cur: dict[str, Any], b: Budget = b) -> dict[str, Any]:
                    held = _kept(cur, now)
                    spent = int(cur.get("spent", 0))
                    was = held.get(request_id)
                    if was is not None and float(was[1]) > now:
                        # Admitted again under the same id (a resend): one hold, shared by
                        # the copies, settled by the one its caller reads (see settle).
                        dups = list(was[3]) if len(was) > 3 else []
                        amount_ = max(int(was[0]), amount)
                        held[request_id] = [amount_, deadline_s, _copies(was) + 1, dups]
                        return _entry({"spent": spent, **_lapsing(cur)}, now, held=held)
                    in_flight = _in_flight(held, now)
                    if b.hard is not None and spent + in_flight + amount > b.hard:
                        raise _over(b, spent, in_flight)
                    held[request_id] = [amount, deadline_s]
                    # A hold of this id that lapsed is forgotten: the id is live again, and
                    # its report settles the live hold, once.
                    return _entry(
                        {"spent": spent, **_lapsing(cur)}, now, held=held, forget=request_id
                    )

                await self._cas(entry, take)
                hold.budgets.append((b, entry))
                self._settled.pop((request_id, entry), None)  # held again: settle it again
                self._held_until[(request_id, entry)] = deadline_s
                if len(self._held_until) > _SETTLED_KEPT:  # never settled here: forgotten
                    del self._held_until[next(iter(self._held_until))]
        except BaseException:
            await self.release(hold)
            raise
        return hold

    def cached_owner_budget(self, owner: str) -> Budget | None:
        """The owner's budget as this book last read it, however long ago (a limiter cut off
        from its store: the owner's budget is not read again until it answers)."""
        hit = self._owners.get(owner) if owner else None
        return None if hit is None else hit[1]

    def reserve_locally(
        self, budgets: list[Budget], request_id: str, amount: int, deadline_s: float, share: float
    ) -> Hold:
        """Hold ``amount`` in this book alone while the store is out of reach (cut-off mode,
        auth/limits.py): within ``share`` of what each hard budget had left as this book last
        wrote its entry (all of it unknown: of the whole budget), counting what it holds so
        already, or raise 429 ``insufficient_quota`` naming the cut. Written into the store
        as a hold by :meth:`flush_local` once it answers, so that the request's report
        settles it there as any."""
        now = time.time()
        hold = Hold(request_id, amount)
        for b in budgets:
            entry = b.entry(now)
            if b.hard is not None:
                known = self._known.get(entry)
                cur = known[0] if known is not None else {}
                spent = int(cur.get("spent", 0))
                in_flight = _in_flight(_kept(cur, now), now)
                mine = sum(a for items in self.local.values() for _, e, a, _ in items if e == entry)
                left = max(0, b.hard - spent - in_flight)
                if mine + amount > share * left:
                    raise E.InsufficientQuota(
                        "the spend budget's store cannot be reached (this site is cut off) and "
                        f"{_whose(b)}'s share of its budget while so "
                        f"(${share * left / 1e6:.4f}) is held by other requests; retry when the "
                        "site is back"
                    )
            hold.budgets.append((b, entry))
        self.local[request_id] = [(b, e, amount, deadline_s) for b, e in hold.budgets]
        self._note_local(request_id)
        return hold

    async def flush_local(self) -> None:
        """Write the holds taken while cut off into the store (each as a hold, no budget
        checked: their requests were admitted), before their reports settle them. A hold
        whose deadline passed meanwhile is kept a minute more for its report."""
        for name, items in list(self.local.items()):
            for _, entry, amount, deadline in items:
                now = time.time()
                until = max(deadline, now + 60.0)

                def put(
                    cur: dict[str, Any],
                    name: str = name,
                    amount: int = amount,
                    until: float = until,
                    now: float = now,
                ) -> dict[str, Any]:
                    held = _kept(cur, now)
                    held.setdefault(name, [amount, until])
                    spent = int(cur.get("spent", 0))
                    return _entry({"spent": spent, **_lapsing(cur)}, now, held=held, forget=name)

                await self._cas(entry, put)
                self._held_until[(name, entry)] = until
            self.local.pop(name, None)
            self._note_local(name)

    async def release(self, hold: Hold) -> None:
        """Give back what ``hold`` holds (the request was not served)."""
        await self.settle(hold, 0)

    async def settle(
        self,
        hold: Hold,
        actual: int,
        *,
        superseding: bool = False,
        produced: int | None = None,
        counted: bool = False,
        duplicate: str | None = None,
    ) -> list[tuple[Budget, int, int]]:
        """Charge ``actual`` and drop the hold, in each entry that still holds it: a hold
        settled once is gone, so the same report settled again (by another limiter, or
        redelivered) charges nothing. (budget, spent before, spent after) of each budget
        whose soft threshold this crossed.

        A worker's report gives ``actual`` (its prompt and all it generated) and ``produced``
        (what the generated tokens alone cost). ``superseding``: the settlement of an attempt
        its caller moved to another replica (auth.ratelimit); the next attempt pays the
        prompt again, so the attempt's price is what its worker *produced*, whichever of the
        two comes first. ``actual`` there is what the caller says it got: a provisional
        price, charged only while the attempt's worker has not reported (it may have died),
        and replaced by ``produced`` when its report comes; where the gateway itself
        ``counted`` it (the HTTP bridge, whose clients say nothing of it), it is the price.
        A client's word never lowers what a worker reported (issue 64: a second attempt
        claiming ``resume.tokens: 0`` made the first answer free). What each report charged,
        and each provisional price, is noted beside the entry (:meth:`_note_charge`) before
        the charge, so any limiter corrects it, not only the one that charged it (which may
        be dead by then).

        ``duplicate`` (the replica that ran it): the report of a copy its caller cancelled
        unread. Where another admission shares its hold (a resend under the same id), the
        copy only leaves the hold to it, once per replica; where none does (each admission
        its own id: ingress's), it settles its own hold at what it produced like any
        report, so no hold is left to its deadline and nothing is charged on the caller's
        word that the copy went unread."""
        crossed = []
        now = time.time()
        # A report of a copy run unread, or of the copy that was read (rank: _BY_*).
        rank = _BY_DUPLICATE if duplicate else _BY_REPORT
        for b, entry in hold.budgets:
            done = (hold.request_id, entry)
            if not superseding and self._settled.get(done, -1) >= rank:
                continue  # settled by this book: the stream's copy of the report
            if duplicate and await self._leave_shared(entry, hold.request_id, duplicate):
                continue
            # What an earlier settlement charged that this one replaces: superseding, the
            # worker's report; a report, the supersede's provisional price, or what the
            # report of a copy run unread charged (``unread``).
            replaced: int | None = None
            price = actual
            unread = False
            if superseding:
                taken = await self._take_charge(entry, hold.request_id, actual, counted)
                if taken is _DONE:
                    self._remember_settled(done, _BY_SUPERSEDE)
                    continue
                if isinstance(taken, tuple):  # the worker's report came first
                    replaced, price = taken
            elif actual > 0 or produced:  # (nothing to correct in a hold given back)
                deadline = self._held_until.get(done)
                try:
                    noted = await self._note_charge(
                        entry, hold.request_id, actual, produced or 0, deadline, bool(duplicate)
                    )
                except _Settled:  # corrected already, or the read copy's report settled it
                    self._remember_settled(done, rank)
                    continue
                if noted is not None:
                    replaced, unread = noted
                    # Moved: the next attempt pays the prompt. After a copy run unread: what
                    # the copy that was read cost, never less than what was charged.
                    price = max(actual, replaced) if unread else produced or 0

            def charge(
                cur: dict[str, Any],
                replaced: int | None = replaced,
                price: int = price,
                unread: bool = unread,
            ) -> dict[str, Any]:
                held = _kept(cur, now)
                spent = int(cur.get("spent", 0))
                if held.pop(hold.request_id, None) is not None:
                    # (Where a copy run unread noted its charge but has not made it yet,
                    # this report's own price: the copy then finds the hold gone.)
                    charged = spent + (actual if unread else price)
                    return _entry(cur, now, spent=charged, held=held)
                if replaced is not None:  # charged once already: corrected to this price
                    return _entry(cur, now, spent=max(0, spent - replaced + price), held=held)
                if not superseding and hold.request_id in _lapsed(cur, now):
                    # A report later than its hold (LAPSED_KEEP_S): charged now, once.
                    return _entry(cur, now, forget=hold.request_id, spent=spent + price, held=held)
                raise _Settled  # settled already, or never held in this entry

            by = _BY_SUPERSEDE if superseding else rank
            try:
                before, after = await self._cas(entry, charge)
            except _Settled:
                self._remember_settled(done, by)
                continue
            self._remember_settled(done, by)
            was, now_spent = int(before.get("spent", 0)), int(after["spent"])
            if (superseding or replaced is not None) and self.log is not None:
                self.log.info(  # a migration's, or a copy's run unread: rare, worth a line
                    "spend_superseded",
                    hold=hold.request_id,
                    entry=entry,
                    price=price,
                    corrected_from=replaced,
                    unread_copy=unread,
                    delta=now_spent - was,
                )
            if b.soft is not None and was < b.soft <= now_spent:
                crossed.append((b, was, now_spent))
        hold.budgets = []
        return crossed

    async def _leave_shared(self, entry: str, request_id: str, replica: str) -> bool:
        """Whether the duplicate copy run by ``replica`` left ``request_id``'s hold in
        ``entry`` to another copy sharing it (once per replica: a redelivered report
        finds itself counted); False where the hold is its alone (or gone)."""
        now = time.time()
        left: list[bool] = []

        def leave(cur: dict[str, Any]) -> dict[str, Any]:
            left.clear()
            held = _kept(cur, now)
            v = held.get(request_id)
            dups = list(v[3]) if v is not None and len(v) > 3 else []
            if replica in dups:
                left.append(True)
                raise _Settled  # counted already
            if v is None or _copies(v) < 2:
                left.append(False)
                raise _Settled
            left.append(True)
            held[request_id] = [v[0], v[1], _copies(v) - 1, [*dups, replica][-8:]]
            return _entry(cur, now, held=held)

        with contextlib.suppress(_Settled):
            await self._cas(entry, leave)
        return bool(left and left[0])

    async def _note_charge(
        self,
        entry: str,
        request_id: str,
        amount: int,
        produced: int,
        deadline: float | None,
        duplicate: bool = False,
    ) -> tuple[int, bool] | None:
        """Note beside ``entry`` that ``request_id``'s report charges ``amount`` (``produced``
        of it for what was generated), for a supersede that may come after it
        (:meth:`settle`). Noted before the charge: a supersede between the two finds the
        note and charges ``produced``. Where a supersede came first and charged its caller's
        word, (that provisional price, False) is returned (and the note closed: corrected
        once); raises ``_Settled`` where it was corrected already.

        ``duplicate``: the report of a copy its caller never read. One admission can run
        twice under one hold: a router that got no acknowledgement in time sends the same
        request to another replica, and the first may run it after all. Whichever of the
        two reports comes first settles the hold; the read copy's report that comes after a
        duplicate's corrects its charge to its own ((the duplicate's charge, True) is
        returned); a duplicate's that comes after the read copy's changes nothing (raises
        ``_Settled``). Before, the duplicate's report settled the hold at the few tokens it
        ran, and the answer's report found it settled (docs/nemesis.md, finding 16)."""
        now = time.time()
        until = round(min(now + CHARGE_NOTE_S, deadline or now + CHARGE_NOTE_S), 1)
        name = _note_name(request_id)
        found: list[tuple[int, bool] | None] = []
        mine = [amount, until, 0, produced, *([_UNREAD] if duplicate else [])]

        def note(cur: dict[str, Any]) -> dict[str, Any]:
            found.clear()
            notes = _live_notes(cur, now)
            v = notes.get(name)
            if v is not None and _superseded(v):
                if len(v) < 4 or v[3] != _PROVISIONAL:
                    raise _Settled  # superseded by the worker's own price: nothing to correct
                found.append((int(v[0]), False))
                notes[name] = [0, round(now + CHARGE_NOTE_S, 1), 1, _FINAL]
                return notes
            if v is not None and duplicate and not _unread(v):
                raise _Settled  # the read copy's report settled it: a duplicate's changes nothing
            if v is not None and not duplicate and _unread(v):
                found.append((int(v[0]), True))
                notes[name] = [max(amount, int(v[0])), until, 0, produced]
                return notes
            found.append(None)
            notes[name] = mine
            if len(notes) > CHARGE_NOTES_KEPT:  # those due soonest go first
                by_due = sorted(notes, key=lambda k: float(notes[k][1]))
                for k in by_due[: len(notes) - CHARGE_NOTES_KEPT]:
                    del notes[k]
            return notes

        await self._cas(_notes_key(entry), note)
        return found[0] if found else None

    async def _take_charge(
        self, entry: str, request_id: str, provisional: int, final: bool = False
    ) -> tuple[int, int] | object | None:
        """(what ``request_id``'s worker report charged in ``entry``, what its generated
        tokens cost), or None: none was charged before this supersede, which is noted as
        charging ``provisional`` until the report comes; or :data:`_DONE`, superseded
        already. Taken once: the note is marked superseded, so a copy of the supersede that
        comes later corrects nothing again. ``final``: ``provisional`` is the price (counted by
        the gateway), whatever the report charged and whenever it comes."""
        now = time.time()
        name = _note_name(request_id)
        taken: list[Any] = []

        def take(cur: dict[str, Any]) -> dict[str, Any]:
            taken.clear()
            notes = _live_notes(cur, now)
            v = notes.get(name)
            if v is not None and _superseded(v):
                raise _Settled  # superseded already
            if v is not None and _unread(v):
                # Charged by the report of a copy run unread, not the attempt's: replaced by
                # the caller's word, provisional until the attempt's own report comes.
                taken.append((int(v[0]), provisional))
                mark = _FINAL if final else _PROVISIONAL
                notes[name] = [provisional, round(now + CHARGE_NOTE_S, 1), 1, mark]
            elif v is not None:
                produced = int(v[3]) if len(v) > 3 else 0
                taken.append((int(v[0]), provisional if final else produced))
                notes[name] = [0, round(now + CHARGE_NOTE_S, 1), 1, _FINAL]
            else:
                taken.append(None)
                mark = _FINAL if final else _PROVISIONAL
                notes[name] = [provisional, round(now + CHARGE_NOTE_S, 1), 1, mark]
            return notes

        try:
            await self._cas(_notes_key(entry), take)
        except _Settled:
            return _DONE
        return taken[0] if taken else None

    def _remember_settled(self, done: tuple[str, str], by: int = _BY_REPORT) -> None:
        self._settled[done] = max(by, self._settled.get(done, _BY_SUPERSEDE))
        self._held_until.pop(done, None)
        if len(self._settled) > _SETTLED_KEPT:
            del self._settled[next(iter(self._settled))]  # the oldest

    async def alert(self, crossed: list[tuple[Budget, int, int]], model: str) -> None:
        """Say on the bus (and in the log) that a soft threshold was crossed."""
        for b, _, spent in crossed:
            body = {
                "type": "budget",
                "scope": b.name or b.scope,
                "period": period_id(b.period),
                "spent_usd": spent / 1e6,
                "soft_usd": (b.soft or 0) / 1e6,
                "hard_usd": None if b.hard is None else b.hard / 1e6,
                "model": model,
            }
            if self.log is not None:
                self.log.warning("budget_soft_threshold_crossed", **body)
            with contextlib.suppress(Exception):
                await self.nc.publish(
                    subjects.telemetry(subjects.TELEMETRY_BUDGET), codec.encode(body)
                )


def _whose(b: Budget) -> str:
    return "this key" if b.scope.startswith("k.") else "this key's owner"


def _over(b: Budget, spent: int, in_flight: int) -> E.InsufficientQuota:
    who = _whose(b)
    return E.InsufficientQuota(
        f"{who} has used its budget of ${(b.hard or 0) / 1e6:.2f} for the {b.period} period "
        f"(${spent / 1e6:.4f} spent, ${in_flight / 1e6:.4f} held by requests in flight); "
        "ask an operator to raise it, or wait for the next period"
    )

"""Flow control in front of one replica's engine: fair shares, priority classes, admission.

Every router and every bridge that routes in-process sends a replica's requests to the one
worker that owns it, so this is the one place where all of them meet: a schedule kept here
holds across any number of routers (two routers cannot each give a tenant a full share).

The worker keeps at most ``slots`` requests in its engine (by default the engine's batch:
more would only queue inside the engine, first come first served). The rest wait here, in
a queue per class, then per flow, and a freed slot goes to:

1. the highest *class* with a request waiting (``priority`` > ``default`` > ``flex``) that
   may still take a slot: the slots reserved for the classes above a class are theirs to
   use, so a class and those below it together hold at most ``slots`` less those (a flood
   of ``flex`` never holds the slots ``default`` needs, and ``default`` requests running in
   their reserve leave the rest of the engine to ``flex``: spare capacity is used). A request that
   has waited ``aging_s`` counts one class higher (again after each further ``aging_s``),
   so nothing waits forever;
2. within the class, the *flow* (an API key, or its owner) with the least service received
   relative to its weight, then within the flow the *fairness id* (a client's agent or
   session) likewise: the Virtual Token Counter of Sheng et al. ("Fairness in Serving Large
   Language Models", OSDI 2024). A flow's counter grows by the tokens it is served (prompt
   tokens weighted ``input_weight``, answer tokens ``output_weight``) divided by its weight;
   a flow that comes back after being idle starts at the least counter among the busy
   flows, so idleness banks no credit (and goes first on a tie with a flow that has
   requests in the engine). Prompts are charged when a request starts, answers when it
   ends;
3. within a fairness id, the earliest deadline (a TTFT objective the client sent), then
   arrival.

A higher-class request that finds no slot it may take displaces the newest lower-class
request in the engine that has not yet sent its first byte: that one goes back to the
head of its queue (it is not failed) and starts over when its turn comes.

Admission: each class's queue is bounded in requests and in prompt tokens; a request is
refused at once when it cannot be queued (429 when its flow holds more than its share of
the class's queue, else the replica is busy and the router tries another, or queues and
answers 503), when its deadline is sooner than its expected wait, or when it has waited
its class's ``max_wait_s`` (and its deadline is enforced while it waits). When a full
queue takes a higher-class request, the newest request of the lowest class present is
shed (503 with ``Retry-After``) to make room: lowest class first.

This module is pure bookkeeping (no I/O): the worker calls :meth:`FlowControl.enter`,
:meth:`FlowControl.wait`, :meth:`FlowControl.started` and :meth:`FlowControl.leave`.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bus_schemas import errors as E

# The classes, highest first: OpenAI's service tiers (``auto`` resolves to the key's default).
CLASSES = ("priority", "default", "flex")
CLASS_RANK = {c: i for i, c in enumerate(CLASSES)}
DEFAULT_CLASS = "default"
_EWMA = 0.2  # of a request's time in the engine
_MAX_FLOWS_KEPT = 10_000  # flows whose tokens served are remembered (for operators)


def class_of(name: str | None, default: str = DEFAULT_CLASS) -> str:
    """A class name as served: ``auto``, empty or unknown names are ``default``."""
    return name if name in CLASS_RANK else default


@dataclass
class FlowConfig:
    """What :class:`FlowControl` needs of the worker's settings (``worker.flow``)."""

    slots: int
    reserved: dict[str, int] = field(default_factory=dict)  # class -> slots kept for it
    max_queued: dict[str, int] = field(default_factory=dict)  # class -> requests (0: no bound)
    max_queued_tokens: dict[str, int] = field(default_factory=dict)  # class -> prompt tokens
    max_wait_s: dict[str, float] = field(default_factory=dict)  # class -> seconds (0: none)
    aging_s: float = 30.0
    input_weight: float = 1.0
    output_weight: float = 2.0
    displace: bool = True


@dataclass(eq=False)
class Ticket:
    """One request's place: in a queue, then in the engine."""

    flow: str
    sub: str  # the fairness id within the flow ("" when none)
    cls: str  # the class asked for (what the answer reports)
    weight: float
    prompt_tokens: int
    deadline: float | None  # monotonic time by which it must start, if any
    objective: float  # ordering key within its fairness id (TTFT deadline, else arrival)
    arrived: float
    seq: int
    granted: asyncio.Event = field(default_factory=asyncio.Event)
    refused: E.TokenbusError | None = None
    in_engine: bool = False
    first_byte: bool = False
    displaced: bool = False  # taken out of the engine before its first byte; waits again
    displacements: int = 0
    on_displace: Callable[[], None] | None = None
    started_at: float = 0.0
    max_tokens: int = 0  # the most it may generate (0: not known)

    def rank(self, now: float, aging_s: float) -> int:
        """The class it counts as now: one higher per ``aging_s`` waited."""
        base = CLASS_RANK[self.cls]
        if aging_s > 0:
            base -= int((now - self.arrived) / aging_s)
        return max(0, base)

    def sort_key(self) -> tuple[float, int]:
        return (self.objective, self.seq)


class _Counters:
    """Virtual token counters of the flows (or of one flow's fairness ids)."""

    def __init__(self) -> None:
        self.vt: dict[str, float] = {}
        self.busy: dict[str, int] = {}  # name -> requests waiting or in the engine

    def join(self, name: str) -> None:
        """``name`` has a request again: an idle name starts at the least busy counter."""
        if self.busy.get(name, 0) == 0:
            floor = min((self.vt[n] for n, b in self.busy.items() if b > 0), default=None)
            if floor is not None:
                self.vt[name] = max(self.vt.get(name, 0.0), floor)
            else:
                self.vt.setdefault(name, 0.0)
        self.busy[name] = self.busy.get(name, 0) + 1

    def part(self, name: str) -> None:
        n = self.busy.get(name, 0) - 1
        if n > 0:
            self.busy[name] = n
            return
        self.busy.pop(name, None)
        if not self.busy:
            # Nobody is busy: counters only matter relative to each other; start afresh.
            self.vt.clear()

    def charge(self, name: str, amount: float) -> None:
        if name in self.busy or name in self.vt:
            self.vt[name] = self.vt.get(name, 0.0) + amount


@dataclass
class _Flow:
    """One flow's waiting requests in one class, per fairness id, in objective order."""

    subs: dict[str, list[Ticket]] = field(default_factory=dict)
    count: int = 0


class FlowControl:
    """The schedule of one replica (see the module's docstring)."""

    def __init__(self, cfg: FlowConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self._seq = itertools.count()
        # class -> flow -> _Flow
        self.queues: dict[str, dict[str, _Flow]] = {c: {} for c in CLASSES}
        self.queued_tokens: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.flows = _Counters()
        self.subs: dict[str, _Counters] = {}
        self.running: list[Ticket] = []
        self.by_rank = [0] * len(CLASSES)  # requests in the engine, per class rank
        self.in_engine: Counter[str] = Counter()  # flow -> its requests in the engine
        self._queued_n: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.mean_service_s = 0.0  # EWMA of a request's time in the engine
        self.sec_per_token = 0.0  # EWMA of that time per answer token
        # What operators see (metrics, status): per class.
        self.shed: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.displaced: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.served: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.wait_sum_s: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
        self.tokens_by_flow: dict[str, int] = {}

    # -- what the worker calls -------------------------------------------------------------
    def enter(
        self,
        *,
        flow: str,
        sub: str = "",
        cls: str = DEFAULT_CLASS,
        weight: float = 1.0,
        prompt_tokens: int = 0,
        deadline: float | None = None,
        ttft_objective_s: float | None = None,
        max_tokens: int = 0,
    ) -> Ticket:
        """A place for a new request: in the engine at once when a slot is free for its
        class (``granted`` set), else in its queue; raises the refusal when it cannot wait."""
        now = self.clock()
        cls = class_of(cls)
        weight = weight if weight > 0 and math.isfinite(weight) else 1.0
        objective = now + ttft_objective_s if ttft_objective_s else math.inf
        t = Ticket(
            flow, sub, cls, weight, max(0, prompt_tokens), deadline, objective, now, next(self._seq)
        )
        t.max_tokens = max(0, max_tokens)
        self.flows.join(flow)
        self.subs.setdefault(flow, _Counters()).join(sub)
        if not self._waiting_above(CLASS_RANK[cls] + 1) and self._may_start(CLASS_RANK[cls]):
            self._start(t, now)
            return t
        try:
            self._admit(t, now)
        except E.TokenbusError:
            self._forget(t)
            raise
        self._queue(t)
        if self.cfg.displace:
            self._displace_for(t)
        return t

    async def wait(self, t: Ticket) -> None:
        """Until ``t`` has a slot; raises its refusal (shed, waited too long, deadline)."""
        while not t.granted.is_set():
            limit = self._wait_limit(t)
            try:
                async with asyncio.timeout(limit):
                    await t.granted.wait()
            except TimeoutError:
                if not t.granted.is_set():
                    self._unqueue(t)
                    t.refused = self._timed_out(t)
            if t.refused is not None:
                raise t.refused

    def started(self, t: Ticket) -> None:
        """``t`` sent its first byte: it may no longer be displaced."""
        t.first_byte = True

    def requeue(self, t: Ticket) -> None:
        """``t`` was displaced before its first byte and its engine run is over: it waits
        again at the head of its fairness id's queue (it keeps its arrival and objective)."""
        t.displaced = False
        t.granted.clear()
        self._queue(t)
        self._fill()

    def leave(self, t: Ticket, completion_tokens: int = 0) -> None:
        """``t`` is done (finished, failed, cancelled): its slot goes to the next request."""
        now = self.clock()
        if t.in_engine:
            self.running.remove(t)
            self.by_rank[CLASS_RANK[t.cls]] -= 1
            self._out_of_engine(t)
            t.in_engine = False
            self._settle(t, completion_tokens, now)
        else:
            self._unqueue(t)
        self._forget(t)
        self._fill()

    # -- the schedule ----------------------------------------------------------------------
    def _limit(self, rank: int) -> int:
        """Slots the classes of ``rank`` and below may hold together: all but those reserved
        for the classes above."""
        kept = sum(self.cfg.reserved.get(c, 0) for c in CLASSES[:rank])
        return max(1, self.cfg.slots - kept)

    def _may_start(self, rank: int) -> bool:
        """Whether a request counting as ``rank`` may take a slot: one is free, and for its
        class and each above it, the requests of that class and below in the engine stay
        within that class's limit (a reserve is a guarantee, not headroom kept empty)."""
        if len(self.running) >= self.cfg.slots:
            return False
        below = 0  # requests in the engine of class rank >= q
        for q in range(len(CLASSES) - 1, 0, -1):
            below += self.by_rank[q]
            if q <= rank and below >= self._limit(q):
                return False
        return True

    def _waiting_above(self, rank: int) -> bool:
        """Whether any request of a class ranked below ``rank`` (higher or equal class)
        waits: a new request does not jump them."""
        return any(self.queues[c] for c in CLASSES[:rank])

    def _start(self, t: Ticket, now: float) -> None:
        t.in_engine = True
        t.started_at = now
        t.first_byte = False
        self.running.append(t)
        self.by_rank[CLASS_RANK[t.cls]] += 1
        self.in_engine[t.flow] += 1
        cost = self._cost(t)
        self.flows.charge(t.flow, cost / t.weight)
        sub = self.subs.get(t.flow)
        if sub is not None:
            sub.charge(t.sub, cost)
        self.served[t.cls] += 1
        self.wait_sum_s[t.cls] += now - t.arrived
        t.granted.set()

    def _cost(self, t: Ticket) -> float:
        """What starting ``t`` charges its flow (before its weight): its prompt. Its answer
        is charged when it ends, as long as it was: an estimate charged up front would, when
        too high, hand the flow slots back as each answer ends short."""
        return self.cfg.input_weight * t.prompt_tokens

    def _uncharge(self, t: Ticket) -> None:
        """Undo what starting ``t`` charged: it was displaced, not served."""
        cost = self._cost(t)
        self.flows.charge(t.flow, -cost / t.weight)
        sub = self.subs.get(t.flow)
        if sub is not None:
            sub.charge(t.sub, -cost)
        self.served[t.cls] -= 1

    def _out_of_engine(self, t: Ticket) -> None:
        n = self.in_engine[t.flow] - 1
        if n > 0:
            self.in_engine[t.flow] = n
        else:
            del self.in_engine[t.flow]

    def _settle(self, t: Ticket, completion_tokens: int, now: float) -> None:
        """Charge the flow the answer's tokens."""
        extra = self.cfg.output_weight * completion_tokens
        self.flows.charge(t.flow, extra / t.weight)
        sub = self.subs.get(t.flow)
        if sub is not None:
            sub.charge(t.sub, extra)
        served = now - t.started_at
        self.mean_service_s = (
            served
            if not self.mean_service_s
            else self.mean_service_s + _EWMA * (served - self.mean_service_s)
        )
        per = served / max(1, completion_tokens)
        self.sec_per_token = (
            per
            if not self.sec_per_token
            else self.sec_per_token + _EWMA * (per - self.sec_per_token)
        )
        self.tokens_by_flow[t.flow] = (
            self.tokens_by_flow.get(t.flow, 0) + completion_tokens + t.prompt_tokens
        )
        if len(self.tokens_by_flow) > _MAX_FLOWS_KEPT:  # memory stays bounded
            keep = sorted(self.tokens_by_flow.items(), key=lambda kv: kv[1])[_MAX_FLOWS_KEPT // 2 :]
            self.tokens_by_flow = dict(keep)

    def _fill(self) -> None:
        """Give free slots to the next requests by class, flow and fairness id."""
        now = self.clock()
        while True:
            t = self._next(now)
            if t is None:
                return
            self._unqueue(t)
            self._start(t, now)

    def _next(self, now: float) -> Ticket | None:
        """The request the next free slot goes to, if any may take one: among the heads of
        the queues, the highest class they count as, then the flow with the least counter
        (ties: the fewest requests in the engine, then the oldest), then within that flow
        the fairness id with the least counter, then the earliest objective. One pass over
        the heads (one per flow and fairness id), then one over the chosen flow's."""
        aging, vt, in_engine = self.cfg.aging_s, self.flows.vt, self.in_engine
        best: tuple[int, float, int, int] | None = None
        chosen = ""
        for c in CLASSES:
            for name, flow in self.queues[c].items():
                for q in flow.subs.values():
                    t = q[0]
                    key = (t.rank(now, aging), vt.get(name, 0.0), in_engine.get(name, 0), t.seq)
                    if best is None or key < best:
                        best, chosen = key, name
        if best is None or not self._may_start(best[0]):
            return None
        rank = best[0]
        sub_vt = self.subs[chosen].vt
        mine = [
            q[0]
            for c in CLASSES
            if chosen in self.queues[c]
            for q in self.queues[c][chosen].subs.values()
            if q[0].rank(now, aging) == rank
        ]
        return min(mine, key=lambda t: (sub_vt.get(t.sub, 0.0), t.sort_key()))

    # -- queues ----------------------------------------------------------------------------
    def _queue(self, t: Ticket) -> None:
        flow = self.queues[t.cls].setdefault(t.flow, _Flow())
        q = flow.subs.setdefault(t.sub, [])
        if t.displacements:
            q.insert(0, t)  # back at the head: it had its turn
        else:
            bisect.insort(q, t, key=Ticket.sort_key)
        flow.count += 1
        self._queued_n[t.cls] += 1
        self.queued_tokens[t.cls] += t.prompt_tokens

    def _unqueue(self, t: Ticket) -> None:
        flows = self.queues[t.cls]
        flow = flows.get(t.flow)
        if flow is None:
            return
        q = flow.subs.get(t.sub)
        if not q or t not in q:
            return
        q.remove(t)
        if not q:
            del flow.subs[t.sub]
        flow.count -= 1
        self._queued_n[t.cls] -= 1
        if not flow.subs:
            del flows[t.flow]
        self.queued_tokens[t.cls] -= t.prompt_tokens

    def _forget(self, t: Ticket) -> None:
        self.flows.part(t.flow)
        sub = self.subs.get(t.flow)
        if sub is not None:
            sub.part(t.sub)
            if not sub.busy:
                del self.subs[t.flow]

    def queued(self, cls: str | None = None) -> int:
        """Requests waiting (of class ``cls``, or all)."""
        if cls is not None:
            return self._queued_n[cls]
        return sum(self._queued_n.values())

    # -- admission -------------------------------------------------------------------------
    def _full(self, cls: str, extra_tokens: int) -> bool:
        bound = self.cfg.max_queued.get(cls, 0)
        if bound and self.queued(cls) >= bound:
            return True
        tokens = self.cfg.max_queued_tokens.get(cls, 0)
        return bool(tokens) and self.queued_tokens[cls] + extra_tokens > tokens

    def _admit(self, t: Ticket, now: float) -> None:
        """Refuse ``t`` at once when it cannot be queued or served in time; make room for it
        by shedding a lower class when its own class has room and the replica does not."""
        if self._full(t.cls, t.prompt_tokens):
            raise self._over(t, "its queue is full")
        wait = self.expected_wait(t)
        if t.deadline is not None and now + wait + self.service_estimate(t) > t.deadline:
            raise E.Overloaded(
                f"the request cannot be served before its deadline (expected wait {wait:.1f} s "
                f"for an engine slot, then about {self.service_estimate(t):.1f} s)",
                headers={"Retry-After": _retry_after(wait)},
            )

    def service_estimate(self, t: Ticket) -> float:
        """Seconds ``t`` may expect to take in the engine: the mean of late, or less when its
        ``max_tokens`` says it is shorter."""
        est = self.mean_service_s
        if t.max_tokens and self.sec_per_token:
            est = min(est, t.max_tokens * self.sec_per_token)
        return est

    def expected_wait(self, t: Ticket) -> float:
        """Seconds ``t`` may expect to wait: the requests that go before it, at the rate
        slots free up (a request's mean time in the engine over the slots)."""
        if not self.mean_service_s:
            return 0.0
        rank = CLASS_RANK[t.cls]
        ahead = sum(self.queued(c) for c in CLASSES[: rank + 1])
        return ahead * self.mean_service_s / max(1, self._limit(rank))

    def _over(self, t: Ticket, why: str) -> E.TokenbusError:
        """429 when ``t``'s flow holds more than its share of the class's queue (the key is
        over its share), else the replica is busy (the router tries another or queues)."""
        flows = self.queues[t.cls]
        mine = flows[t.flow].count if t.flow in flows else 0
        share = self.queued(t.cls) / max(1, len(flows | {t.flow: _Flow()}))
        if mine > 0 and mine >= share:
            return E.RateLimited(
                f"this key already has {mine} requests waiting for model capacity in class "
                f"{t.cls!r}, more than its share; retry later",
                headers={"Retry-After": _retry_after(self.expected_wait(t))},
            )
        return E.ReplicaBusy(f"the {t.cls!r} queue of this replica is full ({why})")

    def shed_for(self, cls: str) -> Ticket | None:
        """Refuse the newest waiting request of the lowest class below ``cls``, if any, to
        make room for a request of class ``cls``: lowest class first."""
        for c in reversed(CLASSES[CLASS_RANK[cls] + 1 :]):
            flows = self.queues[c]
            if not flows:
                continue
            newest = max(
                (q[-1] for f in flows.values() for q in f.subs.values()), key=lambda x: x.seq
            )
            self._unqueue(newest)
            self.shed[c] += 1
            newest.refused = E.Overloaded(
                f"shed for a request of a higher class: the model is overloaded and class "
                f"{c!r} goes first",
                headers={"Retry-After": _retry_after(self.expected_wait(newest))},
            )
            newest.granted.set()
            return newest
        return None

    def _wait_limit(self, t: Ticket) -> float | None:
        limits = []
        max_wait = self.cfg.max_wait_s.get(t.cls, 0.0)
        now = self.clock()
        if max_wait:
            limits.append(t.arrived + max_wait - now)
        if t.deadline is not None:
            # Past this it could not finish before its deadline: refused then, not started.
            limits.append(t.deadline - self.service_estimate(t) - now)
        return max(0.0, min(limits)) if limits else None

    def _timed_out(self, t: Ticket) -> E.TokenbusError:
        self.shed[t.cls] += 1
        now = self.clock()
        if t.deadline is not None and now >= t.deadline:
            return E.Timeout("the request's deadline passed while it waited for model capacity")
        if t.deadline is not None and now >= t.deadline - self.service_estimate(t):
            return E.Overloaded(
                "the request can no longer be served before its deadline (it waited "
                f"{now - t.arrived:.1f} s for model capacity)",
                headers={"Retry-After": _retry_after(self.expected_wait(t))},
            )
        return E.Overloaded(
            f"the request waited its class's limit ({self.cfg.max_wait_s.get(t.cls, 0.0):g} s) "
            "for model capacity",
            headers={"Retry-After": _retry_after(self.expected_wait(t))},
        )

    # -- displacement ----------------------------------------------------------------------
    def _displace_for(self, t: Ticket) -> None:
        """``t`` waits while a lower-class request in the engine has not sent a byte: that
        one goes back to its queue and ``t`` takes its slot."""
        rank = CLASS_RANK[t.cls]
        if self._may_start(rank):
            return
        victims = [
            r
            for r in self.running
            if CLASS_RANK[r.cls] > rank and not r.first_byte and not r.displaced
        ]
        if not victims:
            return
        v = max(victims, key=lambda r: (CLASS_RANK[r.cls], r.started_at))
        v.displaced = True
        v.displacements += 1
        self.displaced[v.cls] += 1
        self.running.remove(v)
        self.by_rank[CLASS_RANK[v.cls]] -= 1
        self._out_of_engine(v)
        v.in_engine = False
        self._uncharge(v)
        self._unqueue(t)
        self._start(t, self.clock())
        if v.on_displace is not None:
            v.on_displace()

    # -- what operators see ----------------------------------------------------------------
    def flow_stats(self, top: int = 20) -> dict[str, dict[str, int]]:
        """Per flow (the busiest ``top`` by tokens, and every one waiting or running): its
        requests waiting and in the engine, and the tokens it has been served here."""
        waiting: Counter[str] = Counter()
        for c in CLASSES:
            for name, f in self.queues[c].items():
                waiting[name] += f.count
        running = Counter(t.flow for t in self.running)
        names = set(waiting) | set(running)
        names |= set(sorted(self.tokens_by_flow, key=self.tokens_by_flow.__getitem__)[-top:])
        return {
            n: {
                "queued": waiting[n],
                "running": running[n],
                "tokens": self.tokens_by_flow.get(n, 0),
            }
            for n in sorted(names)
        }

    def stats(self) -> dict[str, Any]:
        """Per class: queued requests and tokens, served, shed, displaced, mean wait."""
        out: dict[str, Any] = {}
        for c in CLASSES:
            served = self.served[c]
            out[c] = {
                "queued": self.queued(c),
                "queued_tokens": self.queued_tokens[c],
                "running": sum(1 for t in self.running if t.cls == c),
                "served": served,
                "shed": self.shed[c],
                "displaced": self.displaced[c],
                "wait_s_sum": round(self.wait_sum_s[c], 6),
            }
        return out


def _retry_after(wait_s: float) -> str:
    """A ``Retry-After`` value: the expected wait, whole seconds, at least 1."""
    return str(max(1, math.ceil(wait_s)))

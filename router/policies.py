"""Routing policies.

Two kinds compose per model (``router.models.<model>`` in the configuration, or the admin
API at run time):

* a *pool selector* narrows the live replicas to a pool (``concurrency_tiered``: ScaleLLM's
  high-TP pool when the model's traffic is light, the many-replica pool when heavy;
  ``expert``: Expert Router's prompt classifier, see :mod:`router.expert`);
* a *load policy* picks one replica among them: ``least_outstanding``, ``round_robin``,
  ``power_of_two``, ``random``, ``session_affinity`` (consistent hashing with bounded load),
  ``prefix_aware`` (the replica that served the same prompt prefix recently, within a load
  bound: approximate cache-aware routing) or ``kv_aware`` (the replicas' own KV events say
  which holds how much of the prompt: exact cache-aware routing, :class:`KVAware`).

Load is what this router knows: each replica's in-flight count from its heartbeats plus the
requests this router sent since (``Replica.load``), relative to the replica's capacity.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from bus_schemas.messages import message_text, render_prompt
from router.kv_hashing import PromptHashers, scheme_key
from router.registry import Replica
from router.sessions import RecentSessions


@dataclass(slots=True)
class RouteRequest:
    """What policies may look at: the model, a session key and the prompt text."""

    model: str
    session: str | None = None
    prompt: str = ""
    # The prompt as the sim renders it (render_prompt): what kv_aware hashes for sim
    # replicas; and the envelope, which it renders as vLLM does for vllm replicas.
    rendered: str = ""
    env: dict[str, Any] | None = None
    # Its class (service_tier, as auth settled it): predicted_latency's target.
    tier: str = "default"
    # Whose session it is (the key's principal): a session id names nothing of another key's.
    tenant: str = ""


def prompt_text(env: dict[str, Any]) -> str:
    """The envelope's prompt as one string (chat messages in order), for prefix hashing and
    classification."""
    if env.get("prompt") is not None:
        return render_prompt(None, env["prompt"])  # text, or token ids as text
    parts = []
    for m in env.get("messages") or ():
        if isinstance(m, dict):
            role = m.get("role")
            role = role if isinstance(role, str) else ""  # a client's value, not always a str
            parts.append(f"{role}:{message_text(m.get('content'))}\n")
    return "".join(parts)


def utilisation(r: Replica) -> float:
    return r.load / r.max_concurrency


class LoadPolicy(Protocol):
    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Replica: ...


class LeastOutstanding:
    """The replica with the fewest outstanding requests relative to its capacity; ties random."""

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Replica:
        return least_outstanding(candidates)


def least_outstanding(candidates: Sequence[Replica]) -> Replica:
    best: list[Replica] = []
    best_load = math.inf
    for r in candidates:
        load = utilisation(r)
        if load < best_load:
            best, best_load = [r], load
        elif load == best_load:
            best.append(r)
    return best[0] if len(best) == 1 else random.choice(best)


class RoundRobin:
    """Each replica in turn (by replica id), whatever its load."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Replica:
        ordered = sorted(candidates, key=lambda r: r.replica)
        return ordered[next(self._next) % len(ordered)]


class PowerOfTwo:
    """Two replicas at random, the less loaded of them (Mitzenmacher's power of two
    choices: nearly least-loaded quality without looking at every replica)."""

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Replica:
        if len(candidates) == 1:
            return candidates[0]
        a, b = random.sample(list(candidates), 2)
        return a if utilisation(a) <= utilisation(b) else b


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def within_bound(r: Replica, candidates: Sequence[Replica], bound: float) -> bool:
    """Whether ``r`` may take one more request under a bound of ``bound`` times the average
    load (the request counted, each replica's share in proportion to its capacity, rounded
    up: Mirrokni et al.'s ``ceil(c * (m + 1) / n)``). A replica under a sixteenth of its
    capacity (at least 2 requests) is never too loaded: at light load the bound would
    otherwise move sessions on every stale heartbeat."""
    if r.load < max(2, r.max_concurrency // 16):
        return True
    total = sum(c.load for c in candidates) + 1
    capacity = sum(c.max_concurrency for c in candidates)
    return r.load + 1 <= math.ceil(bound * total * r.max_concurrency / capacity)


class SessionAffinity:
    """Consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam): a session
    goes to the first replica clockwise from its hash on a ring of virtual nodes whose load
    is within ``bound`` times the average; requests without a session go to the least loaded.
    A replica joining or leaving moves only the sessions of its ring segments."""

    VNODES = 64

    def __init__(self, bound: float = 1.25) -> None:
        self.bound = bound
        self._ring: tuple[frozenset[str], list[int], list[str]] = (frozenset(), [], [])

    def _ring_for(self, names: frozenset[str]) -> tuple[list[int], list[str]]:
        if self._ring[0] != names:
            points = sorted(
                (_hash64(f"{name}#{i}"), name) for name in names for i in range(self.VNODES)
            )
            self._ring = (names, [p for p, _ in points], [n for _, n in points])
        return self._ring[1], self._ring[2]

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Replica:
        if not req.session or len(candidates) == 1:
            return least_outstanding(candidates)
        by_name = {r.replica: r for r in candidates}
        hashes, names = self._ring_for(frozenset(by_name))
        start = bisect.bisect(hashes, _hash64(req.session))
        seen: set[str] = set()
        for i in range(len(names)):
            name = names[(start + i) % len(names)]
            if name in seen:
                continue
            seen.add(name)
            r = by_name[name]
            if within_bound(r, candidates, self.bound):
                return r
            if len(seen) == len(by_name):
                break
        return least_outstanding(candidates)


@dataclass
class _PrefixTable:
    """Which replica recently served which prompt-prefix block (an LRU of chained block
    hashes), bounded in size and age."""

    max_entries: int = 100_000
    ttl_s: float = 600.0
    entries: OrderedDict[int, tuple[str, float]] = field(default_factory=OrderedDict)

    def lookup(self, blocks: list[int], now: float) -> dict[str, int]:
        """Replica -> how many leading blocks of this prompt it served (block hashes are
        chained, so a hit on block i means the whole prefix up to i was served there)."""
        depth: dict[str, int] = {}
        for i, h in enumerate(blocks):
            hit = self.entries.get(h)
            if hit is None or now - hit[1] > self.ttl_s:
                break
            depth[hit[0]] = i + 1
        return depth

    def record(self, blocks: list[int], replica: str, now: float) -> None:
        for h in blocks:
            self.entries[h] = (replica, now)
            self.entries.move_to_end(h)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


class PrefixAware:
    """Cache-aware routing: the prompt is cut into blocks of ``block_chars`` characters,
    each hashed together with everything before it; the replica that most recently served
    the longest run of the same leading blocks gets the request (its KV cache likely still
    holds that prefix), unless it is loaded beyond ``bound`` times the average; otherwise
    the least loaded replica gets it and the blocks are remembered for it."""

    def __init__(self, bound: float = 1.25, block_chars: int = 256) -> None:
        self.bound = bound
        self.block_chars = block_chars
        self.table = _PrefixTable()

    def blocks(self, text: str) -> list[int]:
        out: list[int] = []
        h = hashlib.blake2b(digest_size=8)
        n = len(text) // self.block_chars
        for i in range(n):
            h.update(text[i * self.block_chars : (i + 1) * self.block_chars].encode())
            out.append(int.from_bytes(h.copy().digest(), "big"))
        return out

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Replica:
        return self.choose_for(candidates, req.prompt)

    def choose_for(self, candidates: Sequence[Replica], prompt: str) -> Replica:
        """:meth:`choose` for a prompt given as ``prompt`` (any one rendering of it)."""
        blocks = self.blocks(prompt)
        now = time.monotonic()
        chosen: Replica | None = None
        if blocks and len(candidates) > 1:
            depth = self.table.lookup(blocks, now)
            for r in sorted(candidates, key=lambda r: -depth.get(r.replica, 0)):
                if depth.get(r.replica, 0) == 0:
                    break
                if within_bound(r, candidates, self.bound):
                    chosen = r
                    break
        if chosen is None:
            chosen = least_outstanding(candidates)
        if blocks:
            self.table.record(blocks, chosen.replica, now)
        return chosen


class Random:
    """Any replica, uniformly (a baseline for benchmarks)."""

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Replica:
        return random.choice(list(candidates))


class KVAware:
    """Exact KV-cache-aware routing: each replica's cached prefix of the prompt comes from
    its own KV events (:class:`router.kv_index.KVIndex`), and one cost per replica weighs
    the prefill it would do against its load, lowest wins (Dynamo's KV router and llm-d's
    scorers weigh the same three)::

        cost = prefix_weight * (1 - cached blocks / prompt blocks)
             + load_weight * in-flight / capacity
             + queue_weight * engine waiting / capacity

    No hard load bound (``bound`` serves the fallbacks only): the load terms decide when a
    cached prefix is worth a busier replica, as in Dynamo's cost, and the dispatcher never
    offers a replica at its capacity. The prompt is rendered and cut into blocks as each
    replica's engine does (:mod:`router.kv_hashing`: the sim's text tokens, or vLLM's
    tokenizer, chat template and hash), once per scheme among the candidates. When
    no candidate's cache is known (an ``openai`` backend, events not yet synchronised, a
    vLLM scheme this router cannot compute) a
    session goes by consistent hashing and anything else by prompt-prefix affinity: the
    approximate routing of ``session_affinity`` / ``prefix_aware`` (over the same rendering:
    the prompt is rendered once). ``last`` holds the cached block count per replica of the
    latest decision; the index counts decisions (its metrics)."""

    def __init__(
        self,
        index: Any,
        *,
        bound: float = 1.25,
        block_chars: int = 256,
        prefix_weight: float = 1.0,
        load_weight: float = 1.0,
        queue_weight: float = 1.0,
    ) -> None:
        self.index = index
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        self.queue_weight = queue_weight
        self.sessions = SessionAffinity(bound)
        self.prefixes = PrefixAware(bound, block_chars)
        self.hashers = PromptHashers()
        self.last: dict[str, int] = {}
        # The prompt's tokens per matchable replica (its scheme's count), from depths().
        self.tokens: dict[str, int] = {}
        # The latest decision's prediction: (replica, prompt tokens it should read cached).
        self.predicted: tuple[str, int] | None = None

    def depths(
        self, candidates: Sequence[Replica], req: RouteRequest
    ) -> tuple[dict[str, int], dict[str, int]] | None:
        """(cached blocks, prompt blocks) per matchable replica: the request hashed once per
        hashing scheme among the synchronised candidates. None: none is matchable."""
        index = self.index
        self.tokens = {}  # this request's counts only: none left from an earlier one
        groups: dict[tuple[Any, ...], list[str]] = {}
        for r in candidates:
            if index.synced(r.replica):
                key = scheme_key(index.hashing(r.replica), index.block_size(r.replica))
                groups.setdefault(key, []).append(r.replica)
        depth: dict[str, int] = {}
        blocks: dict[str, int] = {}
        hashers = self.hashers
        for key, names in groups.items():
            first = names[0]
            hashes = hashers.hashes(
                key,
                index.hashing(first),
                index.block_size(first),
                req.rendered,
                req.env,
                getattr(index, "text_seed", ""),
            )
            if hashes is None:
                continue
            if hashes:
                depth.update(index.lookup(hashes, names))
            for name in names:
                blocks[name] = len(hashes)
                self.tokens[name] = hashers.tokens
        return (depth, blocks) if blocks else None

    def predicted_tokens(self, replica: str, cached_blocks: int) -> int:
        """The prompt tokens ``replica`` should read from its cache for ``cached_blocks``
        matched blocks: whole blocks, all but the last prompt token at most (an engine
        always computes that one)."""
        hashing = self.index.hashing(replica) or {}
        bs = int(hashing.get("block_size") or self.index.block_size(replica) or 0)
        if bs < 1:
            return 0
        tokens = self.tokens.get(replica, 0)
        return min(cached_blocks, max(0, tokens - 1) // bs) * bs

    def prediction(self, replica: str) -> int | None:
        """The latest decision's predicted cached tokens on ``replica`` (None: none made)."""
        p = self.predicted
        return p[1] if p is not None and p[0] == replica else None

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Replica:
        self.predicted = None
        found = self.depths(candidates, req)
        if found is None:
            if req.session:
                return self.sessions.choose(candidates, req)
            return self.prefixes.choose_for(candidates, req.rendered)
        depth, blocks = found
        self.last = depth
        index = self.index
        best: list[Replica] = []
        best_cost = math.inf
        for r in candidates:
            cap = max(1, r.max_concurrency)
            n = max(1, blocks.get(r.replica, 0))
            # A replica whose engine's reports disagree with the index is routed by load:
            # its entries count for nothing (router.kv_check).
            hit = depth.get(r.replica, 0) if index.trusted(r.replica) else 0
            cost = (
                self.prefix_weight * (1.0 - hit / n)
                + self.load_weight * r.load / cap
                + self.queue_weight * r.waiting / cap
            )
            if cost < best_cost - 1e-12:
                best, best_cost = [r], cost
            elif cost <= best_cost + 1e-12:
                best.append(r)
        chosen = best[0] if len(best) == 1 else random.choice(best)
        prompt_blocks = blocks.get(chosen.replica, max(blocks.values()))
        cached = depth.get(chosen.replica, 0)
        predicted = 0
        if chosen.replica in blocks:
            # What the index says it holds, trusted or not: the prediction keeps the loop
            # closed, so a distrusted replica can be seen to agree again.
            predicted = self.predicted_tokens(chosen.replica, cached)
            self.predicted = (chosen.replica, predicted)
        index.decided(prompt_blocks, cached if index.trusted(chosen.replica) else 0, predicted)
        return chosen


# predicted_latency: the fleet counts as behind only while every candidate's predicted time
# per output token is at least this share of the class's target. A backlog that replicas
# with short steps work off between tokens is not past capacity: at the mixed fleet's
# sustainable load the backlog alone put 26-44 % of decisions in that mode and the tail on
# the fast replicas (docs/benchmarks.md, "Behind only with long steps").
FULL_STEPS = 0.75


class PredictedLatency(KVAware):
    """Routes on a model of each replica's latency (llm-d's predicted-latency scorer, with
    rates learned from the replicas' own requests, engine_worker/perf.py, never
    configured): for each candidate, ::

        TTFT = ttft_base + prefill_ms_per_token x prompt tokens it would compute (the prompt
               less its cached prefix, from the KV index) + backlog_ms_per_token x the
               prompt tokens its engine has still to compute for others (its prefill
               backlog, less what the time since it was told has worked off) +
               queue_ms_per_waiting x sequences ahead (engine-waiting, plus this router's
               unacknowledged sends)
        TPOT = tpot_base + tpot_ms_per_running x (running sequences + 1)

    Among the replicas predicted to meet the request's class target (``latency_targets``),
    the lowest TTFT plus ``work_weight`` x the prefill it makes that replica compute x (1 +
    the wait of the backlog it joins there / the class's TTFT target) wins (the request's
    own wait, and the wait it adds for every request behind it there, more of them the
    longer the queue: a cached prefix is worth keeping even when another replica would
    answer this one a little sooner, and more so under load); when none meets the target,
    the same score all the same, and the admission rules already there (the worker's flow
    control by class, the router's bounded queue) decide what waits or is shed. Until every
    candidate has announced a model, ``kv_aware``'s cost routes. While every candidate has
    prefill still to compute for others and steps predicted at :data:`FULL_STEPS` or more of
    the class's time per output token (the fleet is behind: whatever a request makes any
    replica compute, requests already there wait for, between tokens that come late
    already), ``when_behind = "work"`` (the default) drops the TTFT term: the least prefill
    at each replica's own speed, times (1 + the backlog it joins / the target), the soonest
    start among equals; ``"latency"`` keeps the score. With ``neighbour_weight`` set, a new
    session's first request (a session id this router has not sent anywhere within
    ``neighbour_s``) also counts, on each replica, that weight x the prompt tokens a session's
    turn adds (learned from its sessions) x the replica's prefill speed, for every session
    sent there within ``neighbour_s`` (:class:`router.sessions.RecentSessions`): where a
    session starts its next turns queue, beside those of the sessions already there.
    ``last`` holds the latest decision's predictions, replica -> (TTFT, TPOT)."""

    def __init__(
        self,
        index: Any,
        *,
        targets: dict[str, Any] | None = None,
        work_weight: float = 1.0,
        tail_weight: float = 3.0,
        when_behind: str = "work",
        stay_ms: float = 0.0,
        neighbour_weight: float = 0.0,
        neighbour_s: float = 10.0,
        **kw: Any,
    ) -> None:
        super().__init__(index, **kw)
        self.stay_ms = stay_ms
        self.neighbour_weight = neighbour_weight
        self.recent = RecentSessions(neighbour_s)
        self.targets: dict[str, Any] = targets or {}
        self.work_weight = work_weight
        self.tail_weight = tail_weight
        self.when_behind = when_behind
        self.predictions: dict[str, tuple[float, float | None]] = {}
        self.unmet = 0  # decisions against the target that no replica was predicted to meet

    def predict(
        self, r: Replica, depth: dict[str, int], req: RouteRequest
    ) -> tuple[float, float | None]:
        """(TTFT ms, TPOT ms or None) predicted for ``req`` on ``r``."""
        perf = r.perf or {}
        ahead = r.waiting + r.unacked
        per_token = perf.get("prefill_ms_per_token", 0.0)
        ttft = (
            perf.get("ttft_base_ms", 0.0)
            + per_token * self.computed(r, depth, req)
            + r.backlog_wait_ms(time.monotonic())
            + perf.get("queue_ms_per_waiting", 0.0) * ahead
        )
        tpot = None
        if "tpot_base_ms" in perf:
            tpot = perf["tpot_base_ms"] + perf.get("tpot_ms_per_running", 0.0) * (r.running + 1)
        return ttft, tpot

    def work_ms(self, r: Replica, depth: dict[str, int], req: RouteRequest) -> float:
        """The prefill ``req`` would make ``r``'s engine compute, ms: its prompt less the
        prefix cached there, at the replica's learned speed."""
        return (r.perf or {}).get("prefill_ms_per_token", 0.0) * self.computed(r, depth, req)

    def prompt_tokens(self, replica: str, req: RouteRequest) -> int:
        """``req``'s prompt tokens as ``replica``'s scheme counts them (about four characters
        a token where this request's hashing did not count them)."""
        return self.tokens.get(replica) or max(1, -(-len(req.rendered) // 4))

    def computed(self, r: Replica, depth: dict[str, int], req: RouteRequest) -> int:
        """The prompt tokens ``req`` would make ``r`` compute (not read from its cache)."""
        tokens = self.prompt_tokens(r.replica, req)
        cached = 0
        if self.index.trusted(r.replica) and r.replica in self.tokens:
            cached = self.predicted_tokens(r.replica, depth.get(r.replica, 0))
        return max(0, tokens - cached)

    @staticmethod
    def fleet_behind(candidates: Sequence[Replica]) -> bool:
        """Whether every candidate has prompt tokens of others' still to compute now (its
        prefill backlog as last told, less what its engine has worked off since). Then the
        fleet is past what it sustains, and the prefill a request makes any replica compute
        delays requests already there (chunked prefill shares each engine step with every
        running sequence's next token): past capacity, spreading sessions by predicted TTFT
        lost a third to a half of the goodput that ``kv_aware``'s cache affinity kept
        (docs/benchmarks.md, "When the whole fleet is behind")."""
        now = time.monotonic()
        return len(candidates) > 1 and all(r.backlog_wait_ms(now) > 0 for r in candidates)

    @staticmethod
    def steps_full(preds: dict[str, tuple[float, float | None]], target: Any) -> bool:
        """Whether every candidate's predicted time per output token is at least
        :data:`FULL_STEPS` of the class's target (its steps are long: full of prefill)."""
        bound = getattr(target, "tpot_ms", None)
        if not bound:
            return True
        return all(t is not None and t >= FULL_STEPS * bound for _, t in preds.values())

    def _home(self, pool: Sequence[Replica], depth: dict[str, int]) -> Replica | None:
        """The replica of ``pool`` whose cache (trusted: its events checked) holds more of
        the request's prompt tokens than any other's, if one does (a prefix every replica
        holds, a system prompt, makes no home). Tokens, not blocks: block sizes may differ."""
        held = {
            r.replica: self.predicted_tokens(r.replica, depth.get(r.replica, 0))
            for r in pool
            if self.index.trusted(r.replica) and r.replica in self.tokens
        }
        ranked = sorted(held.values(), reverse=True)
        if not ranked or ranked[0] == 0 or (len(ranked) > 1 and ranked[1] >= ranked[0]):
            return None
        return next(r for r in pool if held.get(r.replica) == ranked[0])

    def _meets(self, pred: tuple[float, float | None], target: Any) -> bool:
        ttft, tpot = pred
        if target is None:
            return True
        if ttft > target.ttft_ms:
            return False
        return target.tpot_ms is None or tpot is None or tpot <= target.tpot_ms

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Replica:
        if not self.neighbour_weight or not req.session:
            return self._choose(candidates, req)
        key, now = (req.tenant, req.session), time.monotonic()
        recent = self.recent
        neighbours: dict[str, float] = {}
        if recent.growth and not recent.known(key, now):
            # A new session: its next turns will queue where it starts, beside the sessions
            # already there, each of which will send a turn's new tokens too.
            turn = self.neighbour_weight * recent.growth
            neighbours = {
                r.replica: turn
                * recent.neighbours(r.replica, now)
                * (r.perf or {}).get("prefill_ms_per_token", 0.0)
                for r in candidates
            }
        chosen = self._choose(candidates, req, neighbours)
        recent.heard(key, chosen.replica, self.prompt_tokens(chosen.replica, req), now)
        return chosen

    def _choose(
        self,
        candidates: Sequence[Replica],
        req: RouteRequest,
        neighbours: dict[str, float] | None = None,
    ) -> Replica:
        """The decision; ``neighbours``: a new session's neighbour cost per replica, ms."""
        if any(not r.perf for r in candidates):
            return super().choose(candidates, req)  # not every speed is known yet
        self.predicted = None
        found = self.depths(candidates, req)
        depth, blocks = found if found is not None else ({}, {})
        preds = {r.replica: self.predict(r, depth, req) for r in candidates}
        self.predictions = preds
        target = self.targets.get(req.tier) or self.targets.get("default")
        behind = (
            self.when_behind == "work"
            and self.fleet_behind(candidates)
            and self.steps_full(preds, target)
        )
        w, tail = self.work_weight, 0.0
        if behind:  # the least prefill for the fleet, weighed by the queue it joins
            self.index.behind_decisions += 1
            pool, lead, w = list(candidates), 0.0, max(w, 1.0)
        else:  # the class's target first
            meeting = [r for r in candidates if self._meets(preds[r.replica], target)]
            if not meeting:
                self.unmet += 1
            elif target is not None:
                # Among those that meet it, a wait counts more the nearer it comes to the
                # target: the tail is the requests that joined the longest queues. When none
                # meets it the request's target is lost anyway, and the linear score keeps
                # the fleet's work least (past capacity, its goodput).
                tail = self.tail_weight / target.ttft_ms
            pool, lead = meeting or list(candidates), 1.0
            home = self._home(candidates, depth) if self.stay_ms and meeting else None
            if (
                home is not None
                and any(r is home for r in meeting)
                and preds[home.replica][0] <= self.stay_ms
            ):
                pool = [home]  # the session stays where its prefix is
        now = time.monotonic()
        # The prefill a request adds delays every request that queues behind it there; the
        # longer the queue it joins (its backlog's wait, against the class's TTFT target),
        # the more requests that is.
        room_ms = target.ttft_ms if target is not None else math.inf
        # A new session's wait also counts its neighbours' next turns there (neighbour_weight).
        extra = neighbours or {}
        wait = {r.replica: preds[r.replica][0] + extra.get(r.replica, 0.0) for r in pool}
        score = {
            r.replica: lead * wait[r.replica] * (1 + tail * wait[r.replica])
            + w * self.work_ms(r, depth, req) * (1 + r.backlog_wait_ms(now) / room_ms)
            for r in pool
        }
        best = min(score.values())
        ties = [r for r in pool if score[r.replica] <= best + 1e-9]
        if len(ties) > 1:  # the soonest start among equals
            soonest = min(preds[r.replica][0] for r in ties)
            ties = [r for r in ties if preds[r.replica][0] <= soonest + 1e-9]
        chosen = ties[0] if len(ties) == 1 else random.choice(ties)
        if chosen.replica in blocks:
            cached = depth.get(chosen.replica, 0)
            predicted = self.predicted_tokens(chosen.replica, cached)
            self.predicted = (chosen.replica, predicted)
            trusted = self.index.trusted(chosen.replica)
            self.index.decided(blocks[chosen.replica], cached if trusted else 0, predicted)
        return chosen


LOAD_POLICIES: dict[str, type[Any]] = {
    "least_outstanding": LeastOutstanding,
    "round_robin": RoundRobin,
    "power_of_two": PowerOfTwo,
    "session_affinity": SessionAffinity,
    "prefix_aware": PrefixAware,
    "kv_aware": KVAware,
    "predicted_latency": PredictedLatency,
    "random": Random,
}


def make_load_policy(
    name: str,
    *,
    bound: float,
    block_chars: int,
    kv_index: Any = None,
    kv_weights: dict[str, Any] | None = None,
    latency_targets: dict[str, Any] | None = None,
) -> LoadPolicy:
    if name == "session_affinity":
        return SessionAffinity(bound)
    if name == "prefix_aware":
        return PrefixAware(bound, block_chars)
    if name in ("kv_aware", "predicted_latency"):
        if kv_index is None:
            from router.kv_index import KVIndex

            kv_index = KVIndex()  # nothing feeds it: the approximate fallbacks route
        if name == "predicted_latency":
            return PredictedLatency(
                kv_index,
                targets=latency_targets,
                bound=bound,
                block_chars=block_chars,
                **(kv_weights or {}),
            )
        only_pl = (
            "work_weight",
            "tail_weight",
            "when_behind",
            "stay_ms",
            "neighbour_weight",
            "neighbour_s",
        )
        weights = {k: v for k, v in (kv_weights or {}).items() if k not in only_pl}
        return KVAware(kv_index, bound=bound, block_chars=block_chars, **weights)
    try:
        policy: LoadPolicy = LOAD_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown load policy {name!r}") from None
    return policy


class ConcurrencyTiered:
    """ScaleLLM's dynamic inference load balancing: while the model's in-flight requests
    are below ``threshold`` its requests go to ``high_pool`` (few replicas with a high TP
    degree: the lowest latency per request); at or above it, to ``wide_pool`` (many smaller
    replicas: the most throughput). It goes back once in-flight falls below
    ``threshold - hysteresis``, so it does not flap at the boundary. When the chosen pool
    has no live replica the other pools are used."""

    def __init__(self, threshold: int, hysteresis: int, high_pool: str, wide_pool: str) -> None:
        self.threshold = threshold
        self.hysteresis = hysteresis
        self.high_pool = high_pool
        self.wide_pool = wide_pool
        self.wide: dict[str, bool] = {}

    def pool_for(self, model: str, in_flight: int) -> str:
        wide = self.wide.get(model, False)
        if not wide and in_flight >= self.threshold:
            wide = True
        elif wide and in_flight < self.threshold - self.hysteresis:
            wide = False
        self.wide[model] = wide
        return self.wide_pool if wide else self.high_pool

    def select(
        self, candidates: list[Replica], all_live: Sequence[Replica], req: RouteRequest
    ) -> list[Replica]:
        pool = self.pool_for(req.model, sum(r.load for r in all_live))
        chosen = [r for r in candidates if r.pool == pool]
        return chosen or candidates


def prefer_site(candidates: list[Replica], site: str) -> list[Replica]:
    """The candidates at ``site`` when any is there; else those of the nearest other site
    (spill-over). The dispatcher's candidates are the replicas with room, so a site's own
    replicas take its requests while they have room. A site's distance is the shortest
    smoothed ack time of its replicas (:meth:`Replica.heard_ack`: the link's round trip as
    this router measures it, nothing configured); a replica not measured yet (or not lately)
    goes with the nearest site's, so that it is tried and measured. No site (""): every
    candidate, as before sites."""
    if not site:
        return candidates
    local = [r for r in candidates if r.site == site]
    if local:
        return local
    now = time.monotonic()
    nearest = site_distances(candidates, now)
    if not nearest:
        return candidates
    best = min(nearest.values())
    return [r for r in candidates if nearest.get(r.site, best) <= best or not r.ack_time(now)]


def site_distances(replicas: Sequence[Replica], now: float) -> dict[str, float]:
    """Each site's distance from this router (the shortest fresh smoothed ack time of its
    replicas, seconds), over the sites with a replica measured."""
    out: dict[str, float] = {}
    for r in replicas:
        if ack := r.ack_time(now):
            out[r.site] = min(out.get(r.site, ack), ack)
    return out

"""Issue 68's trace replayed offline against routers that see every replica's exact state.

A research script, not part of tokenbus: it asks whether ``predicted_latency``'s TTFT tail on
the trace is its predictions' error (heartbeats, learned rates) or its structure. Each of four
replicas runs the sim's chunked-prefill step (engine_worker/backends/sim.py ``_plan_step``:
512 tokens a step less one per running sequence, prompts first come first served, a step's
time ``decode_ms`` + ``prefill_ms_per_token`` x its chunk, divided by the replica's tensor
parallel speed-up); a replica's prefix cache holds the shared system prompts it has computed
and each session's last prompt it computed, least recently released first out of 16 384
blocks of 16 tokens (engine_worker/kvcache.py: a sequence's blocks are freed at its end).
Sessions are closed loops, as in ``tokenbus bench --routing-trace``: a turn is sent its think
time after the previous answer's last token.

Policies, each decided at a request's arrival with the exact backlog and cache of every
replica (no heartbeat age, no learned rate):

* ``kv``: ``kv_aware``'s cost (prefix miss share + in-flight / 256 + waiting / 256);
* ``pl``: ``predicted_latency``'s score (TTFT x (1 + ``tail`` x TTFT / 2000) + ``work`` x the
  prefill it adds x (1 + the backlog's wait / 2000)); ``stay=MS``: to the session's home (its
  prefix deeper there than anywhere else) while the TTFT predicted there is at most MS
  (``kv.stay_ms``); ``margin=MS``: home while within MS of the best score's TTFT;
  ``lives=F``: ``kv.neighbour_weight`` (router.sessions.RecentSessions itself, on the
  replay's clock): a new session's first request also counts, on each replica, F x the
  tokens a turn adds (learned) for every session sent there within ``horizon`` s (10).

What it leaves out: the bus, processes and their CPU, the time a decision takes, a live run's
timing noise, and the sim's caching of a prompt at the end of its prefill rather than at the
answer's end. Its ``kv`` lets replicas fall further behind than the live ``kv_aware`` does
(its load is exact where the live one also counts unacknowledged sends), so only its ``pl``
is compared with live runs.

    .venv/bin/python docs/bench/routing/offline_replay.py 6 8 mixed pl,pl:tail=10,kv

prints, per policy, TTFT p50/p99, prompt tokens computed, sessions moved, and for the slowest
1 %: the least TTFT any replica offered at its arrival against the one it was given.
"""

from __future__ import annotations

import heapq
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine_worker.backends.sim import take_chunk
from router.sessions import RecentSessions
from tokenbus.evaluation.trace import Session, TraceShape, generate

BUDGET, DECODE_MS, PREFILL_MS, BLOCK, CACHE_TOKENS = 512, 10.0, 0.2, 16, 16384 * 16
TARGET_MS = 2000.0


class Seq:
    remote = cancelled = False  # (the sim's take_chunk passes those over: none here)

    def __init__(self, s: Session, turn: int, arrival: float, prompt: int, out: int) -> None:
        self.s, self.turn, self.arrival, self.prompt, self.out = s, turn, arrival, prompt, out
        self.left = self.uncached = self.rem = self.replica = 0
        self.ttft = 0.0
        self.best_ms = self.given_ms = 0.0


class Replica:
    def __init__(self, i: int, speed: float) -> None:
        self.i, self.speed = i, speed
        self.running: list[Seq] = []
        self.prefilling: list[Seq] = []
        self.busy = False
        self.cache: dict[tuple[str, int], int] = {}  # insertion order: least recent first
        self.used = 0

    def ms_per_token(self) -> float:
        return (PREFILL_MS + DECODE_MS / BUDGET) / self.speed

    def backlog(self) -> int:
        return sum(q.left for q in self.prefilling)

    def keep(self, key: tuple[str, int], tokens: int) -> None:
        self.used -= self.cache.pop(key, 0)
        self.cache[key] = tokens
        self.used += tokens
        while self.used > CACHE_TOKENS and len(self.cache) > 1:
            self.used -= self.cache.pop(next(iter(self.cache)))

    def cached(self, q: Seq, system_tokens: int) -> int:
        last = self.cache.get(("s", q.s.id), 0)
        if last and last < q.prompt:
            return last // BLOCK * BLOCK
        if ("p", q.s.system) in self.cache:
            return min(system_tokens, q.prompt - 1) // BLOCK * BLOCK
        return 0


def replay(seed: int, rate: float, mixed: bool, policy: str, **kw: float) -> list[Seq]:
    head, sessions = generate(TraceShape(sessions=640, seed=seed, sessions_per_s=rate))
    systems: list[int] = head["system_tokens"]
    reps = [Replica(i, v) for i, v in enumerate([1.9, 1.9, 1.0, 1.0] if mixed else [1.0] * 4)]
    events: list[tuple[float, int, str, Any]] = []
    order = 0

    def push(t: float, kind: str, what: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, what))

    history: dict[int, int] = {}
    recent = RecentSessions(kw.get("horizon", 10.0))
    done: list[Seq] = []
    for s in sessions:
        push(s.arrival_s, "arrive", (s, 0))

    def step(r: Replica, now: float) -> None:
        chunk, last = take_chunk(r.prefilling, BUDGET - len(r.running))
        r.busy = bool(r.running or chunk)
        if r.busy:
            r.prefilling = [q for q in r.prefilling if q.left]
            push(now + (DECODE_MS + PREFILL_MS * chunk) / r.speed / 1000, "step", (r, last))

    def predict(r: Replica, q: Seq) -> tuple[float, float]:
        own = max(1, q.prompt - r.cached(q, systems[q.s.system]))
        return 20 + r.ms_per_token() * (r.backlog() + own), r.ms_per_token() * own

    def choose(q: Seq, now: float) -> Replica:
        if policy == "kv":
            blocks = max(1, math.ceil(q.prompt / BLOCK))
            return min(
                reps,
                key=lambda r: (
                    (1 - r.cached(q, systems[q.s.system]) // BLOCK / blocks)
                    + (len(r.running) + 2 * len(r.prefilling)) / 256
                ),
            )
        tail, work = kw.get("tail", 3.0), kw.get("work", 1.0)
        lives, key = kw.get("lives", 0.0), ("", str(q.s.id))
        turn = lives * recent.growth if lives and not recent.known(key, now) else 0.0

        def score(r: Replica) -> float:
            ttft, own = predict(r, q)
            ttft += turn * recent.neighbours(str(r.i), now) * r.ms_per_token()
            wait = r.ms_per_token() * r.backlog()
            return ttft * (1 + tail * ttft / TARGET_MS) + work * own * (1 + wait / TARGET_MS)

        best = min(reps, key=score)
        stay, margin = kw.get("stay", 0.0), kw.get("margin", 0.0)
        if stay or margin:
            held = sorted((r.cached(q, systems[q.s.system]), r.i) for r in reps)
            if held[-1][0] > held[-2][0]:  # a home: its prefix deeper than anywhere else
                home = reps[held[-1][1]]
                at_home = predict(home, q)[0]
                near = margin and at_home <= predict(best, q)[0] + margin
                if (stay and at_home <= stay) or near:
                    return home
        return best

    def finish(q: Seq, r: Replica, now: float) -> None:
        r.keep(("s", q.s.id), q.prompt)  # its blocks join the cache's free list (LRU) now
        history[q.s.id] = q.prompt + q.out
        done.append(q)
        if q.turn + 1 < len(q.s.turns):
            push(now + float(q.s.turns[q.turn + 1]["think_s"]), "arrive", (q.s, q.turn + 1))

    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            s, n = what
            turn = s.turns[n]
            before = history.get(s.id)
            # The sim's chat template: 5 tokens on a first turn, 24 on each later one.
            template = 24 if before else 5
            prompt = (before or systems[s.system]) + int(turn["user_tokens"]) + template
            q = Seq(s, n, now, prompt, int(turn["output_tokens"]))
            r = choose(q, now)
            recent.heard(("", str(s.id)), str(r.i), prompt, now)
            q.best_ms = min(predict(x, q)[0] for x in reps)
            q.given_ms = predict(r, q)[0]
            q.uncached = q.left = max(1, q.prompt - r.cached(q, systems[s.system]))
            q.replica = r.i
            r.keep(("p", s.system), systems[s.system])
            r.prefilling.append(q)
            if not r.busy:
                step(r, now)
        else:
            r, last = what
            still = []
            for q in r.running:
                q.rem -= 1
                if q.rem > 0:
                    still.append(q)
                else:
                    finish(q, r, now)
            r.running = still
            for q in last:
                q.ttft = now - q.arrival
                q.rem = q.out - 1
                r.keep(("s", q.s.id), q.prompt)
                if q.rem > 0:
                    r.running.append(q)
                else:
                    finish(q, r, now)
            step(r, now)
    return done


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def report(done: list[Seq]) -> dict[str, Any]:
    ttft = [q.ttft * 1000 for q in done]
    last: dict[int, int] = {}
    moves = 0
    for q in sorted(done, key=lambda q: (q.s.id, q.turn)):
        moves += q.s.id in last and last[q.s.id] != q.replica
        last[q.s.id] = q.replica
    slowest = sorted(done, key=lambda q: -q.ttft)[: len(done) // 100]
    return {
        "requests": len(done),
        "ttft_p50_ms": round(pct(ttft, 50)),
        "ttft_p99_ms": round(pct(ttft, 99)),
        "computed_tokens": sum(q.uncached for q in done),
        "session_moves": moves,
        "slowest_1pct": {
            "best_offered_ms_p50": round(pct([q.best_ms for q in slowest], 50)),
            "given_ms_p50": round(pct([q.given_ms for q in slowest], 50)),
            "given_the_best_share": round(
                sum(q.given_ms <= q.best_ms + 1 for q in slowest) / len(slowest), 2
            ),
        },
    }


def main() -> int:
    seed, rate, fleet = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    for spec in sys.argv[4].split(","):
        name, _, args = spec.partition(":")
        kw = {k: float(v) for k, _, v in (a.partition("=") for a in args.split(";") if a)}
        out = report(replay(seed, rate, fleet == "mixed", name, **kw))
        print(seed, fleet, spec, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

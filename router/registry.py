"""Replicas known from heartbeats, with expiry after missed beats and draining honoured."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bus_schemas import messages, subjects
from services import natsclient

# A heartbeat's interval, bounded (bus_schemas.messages.announced_interval).
MAX_INTERVAL_S = messages.MAX_INTERVAL_S
_interval = messages.announced_interval


# What a replica whose heartbeat names no endpoints (an older worker) serves.
DEFAULT_ENDPOINTS = frozenset({subjects.KIND_CHAT, subjects.KIND_COMPLETIONS})


# The weight of a new ack time in a replica's average (:meth:`Replica.heard_ack`), and how
# long the average stands for the replica's link without a new one.
ACK_WEIGHT = 0.2
ACK_FRESH_S = 30.0


@dataclass(slots=True)
class Replica:
    """What a router knows of one replica."""

    replica: str
    model: str
    subject: str
    backend: str = ""
    reported_in_flight: int = 0
    # Requests this router sent that the replica has not acknowledged yet.
    unacked: int = 0
    max_concurrency: int = 1
    running: int = 0
    waiting: int = 0
    # Prompt tokens its engine has still to compute (engine_worker/backlog.py), as its
    # latest ack or heartbeat said at ``backlog_at`` (monotonic), plus this router's sends
    # since: predicted_latency's queue.
    backlog_tokens: int = 0
    backlog_at: float = 0.0
    tp: int = 1
    pool: str = "default"
    # The site it runs at (its heartbeat's; "": not said), for the site preference.
    site: str = ""
    # The host it runs on (its heartbeat's; "": not said), for operators.
    host: str = ""
    # Prefill/decode disaggregation: "prefill", "decode" or "both" (docs/disaggregation.md).
    pd_role: str = "both"
    draining: bool = False
    interval_s: float = 1.0
    last_seen: float = 0.0
    seq: int = 0
    boot: str = ""
    # Request kinds it serves (chat, completions, embeddings), from its heartbeat.
    endpoints: frozenset[str] = DEFAULT_ENDPOINTS
    # Other model names it answers to (LoRA adapters, extra served names).
    aliases: frozenset[str] = frozenset()
    # LoRA adapters it loaded at run time, name -> path (docs/adapters.md).
    adapters: dict[str, str] = field(default_factory=dict)
    # The model's context length in tokens, from its heartbeat (0: not known).
    max_model_len: int = 0
    # Its flow control per class and per flow (engine_worker/flow.py), for operators.
    flow: dict[str, Any] | None = None
    flows: dict[str, Any] | None = None
    # How it reports its prefix cache ("text": the sim's events, "vllm": vLLM's); "": no
    # events, so kv_aware keeps approximate affinity for it.
    kv_events: str = ""
    # What its upstream can do (the openai backend's probe), for operators; None: no upstream.
    upstream: dict[str, Any] | None = None
    # What makes its block hashes comparable (its heartbeat's kv_hashing; None: not said).
    kv_hashing: dict[str, Any] | None = None
    # The closed loop's totals from its heartbeats: predicted and reported cached tokens.
    kv_check: dict[str, int] | None = None
    # Its engine's speed as it learned it (engine_worker/perf.py); None: not learned yet.
    perf: dict[str, float] | None = None
    # How long its acks take to come back to this router, smoothed (seconds; 0: none yet):
    # the round trip of the link to its site and its worker's accept, as this router sees it.
    ack_s: float = 0.0
    ack_at: float = 0.0  # when the last ack came (monotonic)

    @property
    def continues(self) -> bool:
        """Whether it continues a chat answer cut off elsewhere exactly: every engine does
        but an upstream that was not shown to continue a message."""
        return self.upstream is None or self.upstream.get("continue_message") is True

    def serves(self, model: str) -> bool:
        return model == self.model or model in self.aliases

    def backlog_ms_per_token(self) -> float:
        """What a token of its backlog costs its engine, as it learned it (0: not known)."""
        perf = self.perf or {}
        return float(perf.get("backlog_ms_per_token") or perf.get("prefill_ms_per_token") or 0.0)

    def backlog_now(self, now: float) -> float:
        """Its prefill backlog now: as last told, less what its engine has worked off since
        at its learned speed (as told when the speed is not known)."""
        rate = self.backlog_ms_per_token()
        if self.backlog_tokens <= 0 or rate <= 0:
            return float(self.backlog_tokens)
        return max(0.0, self.backlog_tokens - max(0.0, now - self.backlog_at) * 1000.0 / rate)

    def backlog_wait_ms(self, now: float) -> float:
        """What its prefill backlog now takes its engine, ms (0 while its speed is unknown)."""
        return self.backlog_ms_per_token() * self.backlog_now(now)

    def add_backlog(self, tokens: int, now: float) -> None:
        """This router sent it ``tokens`` more to compute (until its ack says how many)."""
        self.backlog_tokens = round(self.backlog_now(now)) + tokens
        self.backlog_at = now

    def told_backlog(self, tokens: int, now: float) -> None:
        """Its ack or heartbeat said its backlog is ``tokens``."""
        self.backlog_tokens, self.backlog_at = max(0, tokens), now

    def heard_ack(self, seconds: float) -> None:
        """An ack came back ``seconds`` after its request was sent (an exponential average
        over the last few, so one slow accept does not move a site away)."""
        seconds, now = max(0.0, seconds), time.monotonic()
        fresh = self.ack_s > 0 and now - self.ack_at <= ACK_FRESH_S
        self.ack_s = self.ack_s + ACK_WEIGHT * (seconds - self.ack_s) if fresh else seconds
        self.ack_at = now

    def ack_time(self, now: float) -> float:
        """Its smoothed ack time while fresh (:data:`ACK_FRESH_S`), else 0 (not known: a
        link that was slow once is measured again rather than avoided for good)."""
        return self.ack_s if self.ack_s > 0 and now - self.ack_at <= ACK_FRESH_S else 0.0

    @property
    def load(self) -> int:
        """Outstanding requests as this router estimates them."""
        return self.reported_in_flight + self.unacked

    def to_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "model": self.model,
            "backend": self.backend,
            "in_flight": self.reported_in_flight,
            "running": self.running,
            "waiting": self.waiting,
            "max_concurrency": self.max_concurrency,
            "tp": self.tp,
            "pool": self.pool,
            **({"site": self.site} if self.site else {}),
            **({"host": self.host} if self.host else {}),
            **({"pd_role": self.pd_role} if self.pd_role != "both" else {}),
            "draining": self.draining,
            "endpoints": sorted(self.endpoints),
            **({"aliases": sorted(self.aliases)} if self.aliases else {}),
            **({"adapters": dict(sorted(self.adapters.items()))} if self.adapters else {}),
            **({"max_model_len": self.max_model_len} if self.max_model_len else {}),
            **({"flow": self.flow, "flows": self.flows} if self.flow else {}),
            "kv_routing": f"exact ({self.kv_events})" if self.kv_events else "approximate",
            **({"upstream": self.upstream} if self.upstream is not None else {}),
            **(
                {"ack_ms": round(ack * 1000, 2)} if (ack := self.ack_time(time.monotonic())) else {}
            ),
        }


class Registry:
    """Live replicas per model from heartbeats."""

    def __init__(self, missed_heartbeats: int = 3) -> None:
        self.missed = missed_heartbeats
        # The connection the heartbeats arrive on: while its server is quiet (stalled, or
        # the connection is reconnecting) replicas are not expired for the silence.
        self.bus: Any = None
        self._replicas: dict[str, Replica] = {}
        self._ever_seen: set[str] = set()
        # Whether any prefill replica ever beat here: until one does, a router skips the
        # prefill/decode decision (one look per request instead of a scan).
        self.prefill_seen = False

    def update(self, hb: dict[str, Any]) -> Replica | None:
        """Apply one heartbeat; returns the replica, or None when the heartbeat is malformed."""
        try:
            rid = str(hb["replica"])
            model = str(hb["model"])
            r = self._replicas.get(rid)
            if r is None or r.model != model:
                r = Replica(replica=rid, model=model, subject=subjects.engine_generate(model, rid))
                self._replicas[rid] = r
            seq = int(hb.get("seq", 0))
            boot = str(hb.get("boot", ""))
            if boot == r.boot and seq and seq < r.seq:
                return r  # an older beat overtaken by a newer one (same process)
            r.seq = seq
            r.boot = boot
            r.backend = str(hb.get("backend", ""))
            r.reported_in_flight = int(hb.get("in_flight", 0))
            r.max_concurrency = max(1, int(hb.get("max_concurrency", 1)))
            r.running = int(hb.get("running", 0))
            r.waiting = int(hb.get("waiting", 0))
            r.told_backlog(int(hb.get("prefill_backlog") or 0), time.monotonic())
            r.tp = int(hb.get("tp", 1))
            r.pool = str(hb.get("pool", "default"))
            r.site = str(hb.get("site") or "")
            r.host = str(hb.get("host") or "")[:255]
            r.pd_role = str(hb.get("pd_role", "both"))
            self.prefill_seen = self.prefill_seen or r.pd_role == "prefill"
            r.draining = bool(hb.get("draining", False))
            r.interval_s = _interval(hb.get("interval_s", 1.0))
            eps = hb.get("endpoints")
            r.endpoints = frozenset(map(str, eps)) if eps else DEFAULT_ENDPOINTS
            r.aliases = frozenset(map(str, hb.get("aliases") or ()))
            held = hb.get("adapters")
            self.set_adapters(
                r, {str(k): str(v) for k, v in held.items()} if isinstance(held, dict) else {}
            )
            r.max_model_len = max(0, int(hb.get("max_model_len") or 0))
            flow, flows = hb.get("flow"), hb.get("flows")
            r.flow = flow if isinstance(flow, dict) else None
            r.flows = flows if isinstance(flows, dict) else None
            r.kv_events = str(hb.get("kv_events") or "")
            hashing = hb.get("kv_hashing")
            r.kv_hashing = hashing if isinstance(hashing, dict) else None
            perf = hb.get("perf")
            r.perf = (
                {str(k): float(v) for k, v in perf.items() if isinstance(v, int | float)}
                if isinstance(perf, dict)
                else None
            )
            check = hb.get("kv_check")
            r.kv_check = (
                {k: int(check.get(k) or 0) for k in ("requests", "predicted", "reported")}
                if isinstance(check, dict)
                else None
            )
            up = hb.get("upstream")
            r.upstream = up if isinstance(up, dict) else None
            r.last_seen = time.monotonic()
        # int() of an infinite float raises OverflowError; str() of a deep nesting,
        # RecursionError: a forged beat either way.
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError):
            return None
        self._ever_seen.add(model)
        self._ever_seen.update(r.aliases)
        return r

    def set_adapters(self, r: Replica, adapters: dict[str, str]) -> None:
        """``r`` holds ``adapters`` now (run-time LoRA adapters, name -> path). One it
        unloaded that no other replica serves is a model this registry never saw again: a
        request for it is a 404, not a "retry shortly" (a replica that died keeps its
        adapters' names known: they come back with a replica)."""
        for name in r.adapters.keys() - adapters.keys():
            r.aliases = r.aliases - {name}
            if not any(q is not r and q.serves(name) for q in self._replicas.values()):
                self._ever_seen.discard(name)
        r.adapters = adapters
        self._ever_seen.update(adapters)

    def add_adapter(self, r: Replica, name: str, path: str) -> None:
        """``r`` loaded ``name`` from ``path`` (its load answered): it takes its requests
        from now, before its next heartbeat says so."""
        self.set_adapters(r, {**r.adapters, name: path})
        r.aliases = r.aliases | {name}

    def _alive(self, r: Replica, now: float) -> bool:
        return natsclient.silent_for(self.bus, r.last_seen, now) <= r.interval_s * self.missed

    def prune(self) -> None:
        """Forget replicas whose heartbeats stopped."""
        now = time.monotonic()
        for rid in [k for k, r in self._replicas.items() if not self._alive(r, now)]:
            del self._replicas[rid]

    def remove(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    def get(self, replica: str) -> Replica | None:
        return self._replicas.get(replica)

    def alive(self, replica: str) -> bool:
        """Whether ``replica`` still beats (its heartbeats not missed)."""
        r = self._replicas.get(replica)
        return r is not None and self._alive(r, time.monotonic())

    def live(self, model: str, kind: str | None = None) -> list[Replica]:
        """Replicas of ``model`` that are alive and not draining (and serve ``kind``)."""
        now = time.monotonic()
        return [
            r
            for r in self._replicas.values()
            if r.serves(model)
            and not r.draining
            and self._alive(r, now)
            and (kind is None or kind in r.endpoints)
        ]

    def all_live(self) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self._replicas.values() if self._alive(r, now)]

    def models(self) -> list[str]:
        """Models with at least one live, non-draining replica."""
        return sorted({m for r in self.all_live() if not r.draining for m in (r.model, *r.aliases)})

    def context_length(self, model: str) -> int:
        """The shortest context length the live replicas of ``model`` announce (0 when none
        says): a request that cannot fit it may still fit a longer one, so refusals use it
        only when every replica agrees the request cannot fit (see :meth:`longest_context`)."""
        lens = [r.max_model_len for r in self.live(model) if r.max_model_len]
        return min(lens) if lens else 0

    def longest_context(self, model: str) -> int:
        """The longest context length among the live replicas of ``model``; 0 when any of
        them does not say (it may take anything)."""
        lens = [r.max_model_len for r in self.live(model)]
        return max(lens) if lens and all(lens) else 0

    def adapter(self, name: str) -> tuple[str, str] | None:
        """(base model, path) of ``name`` when a live replica loaded it at run time."""
        for r in self.all_live():
            if name in r.adapters:
                return r.model, r.adapters[name]
        return None

    def ever_seen(self, model: str) -> bool:
        return model in self._ever_seen

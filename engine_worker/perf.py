"""What a replica learns of its own engine's speed from the requests it serves, announced in
its heartbeats (``perf``) for the ``predicted_latency`` routing policy (docs/routing.md).

Two linear models, each fitted online by recursive least squares with exponential
forgetting (old requests fade, so a replica that slows down or speeds up is followed):

- time to first token in the engine, ms = ``ttft_base_ms`` + ``prefill_ms_per_token`` x (the
  prompt tokens it computed, not read from its prefix cache, + the prompt tokens of other
  requests the engine had still to compute when it entered: its prefill backlog,
  engine_worker/backlog.py) + ``queue_ms_per_waiting`` x the sequences waiting in the
  engine then. The backlog is what is left of the prompts ahead, which the engine computes
  first come, first served at the same speed as this one's, so one coefficient prices both
  (announced as ``backlog_ms_per_token`` too): fitted apart, the backlog's took fifty
  requests and more to learn on a replica that seldom had one, and priced a burst's queue at
  a tenth of its cost until then (docs/routing.md, "The backlog");
- time per output token, ms = ``tpot_base_ms`` + ``tpot_ms_per_running`` x the sequences
  running beside it.

Nothing is configured: a replica with too few requests announces nothing yet.
"""

from __future__ import annotations

from typing import Any

# How fast old requests fade (per request): about the last few hundred count.
FORGET = 0.995
# Requests before a model is announced.
MIN_SAMPLES = 8


class OnlineLinear:
    """``y ~ w . x`` by recursive least squares with forgetting factor ``forget``."""

    def __init__(self, n: int, forget: float = FORGET, prior: float = 1e4) -> None:
        self.n = n
        self.forget = forget
        self.w = [0.0] * n
        self.p = [[prior if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.samples = 0

    def add(self, x: list[float], y: float) -> None:
        n, p, lam = self.n, self.p, self.forget
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        k = [v / denom for v in px]
        err = y - sum(self.w[i] * x[i] for i in range(n))
        self.w = [self.w[i] + k[i] * err for i in range(n)]
        # P = (P - k (x^T P)) / lambda; x^T P = px^T (P symmetric).
        self.p = [[(p[i][j] - k[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        self.samples += 1


class EnginePerf:
    """The replica's two latency models (see the module docstring)."""

    def __init__(self) -> None:
        self.ttft = OnlineLinear(3)
        self.tpot = OnlineLinear(2)

    def observe(
        self,
        *,
        ttft_ms: float,
        computed_tokens: int,
        waiting: int,
        ahead_tokens: int = 0,
        tpot_ms: float | None,
        running: int,
    ) -> None:
        """One finished request: its engine TTFT, the prompt tokens computed, the engine's
        waiting sequences and prefill backlog (``ahead_tokens``) when it entered, and (with
        two or more output tokens) its time per output token and the sequences running
        beside it."""
        x = [1.0, float(computed_tokens) + float(ahead_tokens), float(waiting)]
        self.ttft.add(x, ttft_ms)
        if tpot_ms is not None:
            self.tpot.add([1.0, float(max(0, running))], tpot_ms)

    def prefill_ms_per_token(self) -> float:
        """What a prompt token costs the engine as learned so far (0: too few requests)."""
        return max(0.0, self.ttft.w[1]) if self.ttft.samples >= MIN_SAMPLES else 0.0

    def heartbeat(self) -> dict[str, Any] | None:
        """The models as heartbeats carry them (``perf``), once each has enough requests;
        coefficients are never below 0 (a fit on few, similar requests may dip)."""
        if self.ttft.samples < MIN_SAMPLES:
            return None
        base, per_token, per_waiting = self.ttft.w
        out: dict[str, Any] = {
            "samples": self.ttft.samples,
            "ttft_base_ms": round(max(0.0, base), 3),
            "prefill_ms_per_token": round(max(0.0, per_token), 6),
            "backlog_ms_per_token": round(max(0.0, per_token), 6),
            "queue_ms_per_waiting": round(max(0.0, per_waiting), 3),
        }
        if self.tpot.samples >= MIN_SAMPLES:
            tb, tr = self.tpot.w
            out["tpot_base_ms"] = round(max(0.0, tb), 3)
            out["tpot_ms_per_running"] = round(max(0.0, tr), 4)
        return out

"""A worker's engine health: whether its engine died or is stuck, and what the worker does
then (out of routing, its requests handed back, the process restarted)."""

from __future__ import annotations

import os
import threading
import time

from engine_worker.replica import Replica

# A worker whose engine died or is stuck exits with this status (EX_TEMPFAIL: start it again)
# once its requests were handed back, at the latest this long after it found out.
ENGINE_FAILED_EXIT = 75
ENGINE_EXIT_GRACE_S = 15.0


class EngineHealth:
    """The health of one replica's engine, checked before each heartbeat."""

    def __init__(self, worker: Replica) -> None:
        self.w = worker
        # Why the engine cannot serve (it died, or stopped making output): set once.
        self.failure: str | None = None
        self.progress_at = time.monotonic()  # the engine's last output, any request's

    async def check(self) -> None:
        """Act on a problem found now, once."""
        if self.failure is None:
            problem = self.problem()
            if problem is not None:
                await self.lost(problem)

    def problem(self) -> str | None:
        """Why the engine cannot serve, or None: the backend says it died (vLLM's engine
        core), or no request in flight has had any output for ``engine_stuck_s``."""
        w = self.w
        health = getattr(w.backend, "health", None)
        problem = health() if callable(health) else None
        if problem:
            return str(problem)
        stuck = float(w.cfg.engine_stuck_s)
        quiet = time.monotonic() - self.progress_at
        if stuck > 0 and w._active and quiet > stuck:
            return f"made no output for {quiet:.0f} s with {len(w._active)} requests in flight"
        return None

    async def lost(self, problem: str) -> None:
        """Out of routing at once (a beat that says so), every request in flight ended with
        a retryable ``replica_lost`` (its caller moves it to another replica), then the
        process exits with :data:`ENGINE_FAILED_EXIT` so that its supervisor (compose's
        restart policy, Kubernetes, ``tokenbus up``) starts it again; a stuck engine that
        does not let it stop cleanly is left after :data:`ENGINE_EXIT_GRACE_S`."""
        w = self.w
        self.failure = problem
        w.draining = True
        w.log.error("engine_failed", reason=problem, in_flight=len(w._active))
        await w.heartbeat()
        for task in list(w._active.values()):
            task.cancel()
        w.give_up(f"replica {w.replica}: the engine {problem}", ENGINE_FAILED_EXIT)
        timer = threading.Timer(ENGINE_EXIT_GRACE_S, os._exit, (ENGINE_FAILED_EXIT,))
        timer.daemon = True
        timer.start()

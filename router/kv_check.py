"""A router's checks of the replicas' KV caches against its own view (docs/routing.md,
"Checking the KV index").

**At join.** Replicas announce in their heartbeats what makes their block hashes comparable
(``kv_hashing``: the scheme, block size, seed, model). A replica this router would hash
otherwise (another block size than ``router.kv_check.block_size``, another seed of the sim's
hash than ``router.kv_check.hash_seed``, vLLM's random seed, a scheme it does not know) is
*incompatible*: its KV events are refused (never indexed, so never routed as if it hit),
one error names both sides, and ``tokenbus_kv_incompatible_replicas`` counts it.

**Closed loop.** Every dispatch carries the router's predicted cached prompt tokens; the
worker sums them beside its engine's reported ``cached_tokens`` (``kv_check`` in its
heartbeats). Over ``window_s`` of heartbeats, a replica whose reported tokens differ from
the predicted ones by more than ``tolerance`` of the larger (once either reaches
``min_tokens``) *disagrees*: ``kv_aware`` routes it by load (its index entries count for
nothing) and it is logged once, with the numbers, until it agrees again (logged too).
Predictions are still made for it meanwhile, so the loop stays closed.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bus_schemas import kv_events as kv
from router.registry import Replica
from services.config import KVCheckSettings


@dataclass
class _Loop:
    """One replica's closed-loop samples: (monotonic time, predicted, reported) totals."""

    boot: str = ""
    samples: deque[tuple[float, int, int]] = field(default_factory=deque)


class KVCheck:
    """Which replicas' KV events this router refuses, and which it distrusts; see the module
    docstring."""

    def __init__(self, cfg: KVCheckSettings | None, log: Any) -> None:
        self.cfg = cfg or KVCheckSettings()
        self.log = log
        self.incompatible: dict[str, str] = {}  # replica -> why
        self.disagreeing: dict[str, str] = {}  # replica -> why
        self.refused_batches = 0
        self._judged: dict[str, str] = {}  # replica -> the hashing last judged (JSON)
        self._loops: dict[str, _Loop] = {}

    # -- at join ------------------------------------------------------------------------------
    def router_side(self, hashing: dict[str, Any]) -> dict[str, Any]:
        """How this router hashes a prompt of ``hashing``'s kind (for the error)."""
        out: dict[str, Any] = {"kind": hashing.get("kind")}
        out["block_size"] = self.cfg.block_size or "the replica's"
        if hashing.get("kind") == kv.SCHEME_TEXT:
            out["seed"] = self.cfg.hash_seed
        elif hashing.get("kind") == kv.SCHEME_VLLM:
            out["algos"] = list(kv.VLLM_HASH_ALGOS)
            out["seed"] = "the replica's (a fixed one)"
        return out

    def why_incompatible(self, hashing: dict[str, Any] | None) -> str | None:
        """Why this router cannot compute ``hashing``'s block hashes; None when it can (or the
        replica did not say: an older worker is not judged)."""
        if not isinstance(hashing, dict) or not isinstance(hashing.get("kind"), str):
            return None
        kind = hashing.get("kind")
        size = hashing.get("block_size")
        if self.cfg.block_size and isinstance(size, int) and size != self.cfg.block_size:
            return f"block size {size}, this router hashes blocks of {self.cfg.block_size}"
        if kind == kv.SCHEME_TEXT:
            seed = str(hashing.get("seed") or "")
            if seed != self.cfg.hash_seed:
                return f"hash seed {seed!r}, this router's is {self.cfg.hash_seed!r}"
            return None
        if kind == kv.SCHEME_VLLM:
            if hashing.get("seed") is None:
                return "the engine's hash seed is random (set PYTHONHASHSEED on the replica)"
            if hashing.get("algo") not in kv.VLLM_HASH_ALGOS:
                return f"hash algorithm {hashing.get('algo')!r} is not one this router computes"
            return None
        return f"hashing {kind!r} is not one this router computes"

    def admit(self, r: Replica) -> bool:
        """Judge ``r``'s announced hashing (logged when the verdict is new): True when its
        events may be indexed."""
        hashing = r.kv_hashing
        # Any JSON the heartbeat carried (a hostile role's lists and maps too) as one key.
        key = json.dumps(hashing, sort_keys=True, default=str)
        if self._judged.get(r.replica) == key:
            return r.replica not in self.incompatible
        self._judged[r.replica] = key
        why = self.why_incompatible(hashing)
        if why is None:
            if self.incompatible.pop(r.replica, None) is not None:
                self.log.info("kv_hashing_compatible", replica=r.replica, model=r.model)
            return True
        assert hashing is not None
        self.incompatible[r.replica] = why
        # A known scheme hashed otherwise is an operator's mistake to fix (error); a scheme
        # this router has never heard of is a newer worker, or a heartbeat made up.
        known = hashing.get("kind") in (kv.SCHEME_TEXT, kv.SCHEME_VLLM)
        say = self.log.error if known else self.log.warning
        say(
            "kv_hashing_mismatch",
            replica=r.replica,
            model=r.model,
            reason=why,
            replica_hashing=hashing,
            router_hashing=self.router_side(hashing),
            action="its KV events are refused; kv_aware routes it by load",
        )
        return False

    def refuses(self, replica: str) -> bool:
        """Whether ``replica``'s events are refused (counted)."""
        if replica in self.incompatible:
            self.refused_batches += 1
            return True
        return False

    # -- the closed loop ----------------------------------------------------------------------
    def observe(self, r: Replica, now: float) -> None:
        """Take ``r``'s latest totals and judge the window behind them."""
        totals = r.kv_check
        if totals is None:
            return
        loop = self._loops.get(r.replica)
        if loop is None or loop.boot != r.boot:
            loop = self._loops[r.replica] = _Loop(r.boot)
        sample = (now, int(totals.get("predicted", 0)), int(totals.get("reported", 0)))
        s = loop.samples
        if not s or sample[1:] != s[-1][1:]:
            s.append(sample)
        # The baseline: the newest sample at least a window old (or the oldest there is).
        while len(s) > 2 and s[1][0] <= now - self.cfg.window_s:
            s.popleft()
        first, last = s[0], s[-1]
        predicted, reported = last[1] - first[1], last[2] - first[2]
        larger = max(predicted, reported)
        if larger < self.cfg.min_tokens:
            return  # too little to judge: the verdict stands
        off = abs(reported - predicted) > self.cfg.tolerance * larger
        if off and r.replica not in self.disagreeing:
            why = (
                f"its engine reported {reported} cached prompt tokens where this router's "
                f"KV index predicted {predicted} (over {now - first[0]:.0f} s)"
            )
            self.disagreeing[r.replica] = why
            self.log.warning(
                "kv_replica_disagrees",
                replica=r.replica,
                model=r.model,
                reason=why,
                action="routed by load, not by its KV events, until it agrees again",
            )
        elif not off and r.replica in self.disagreeing:
            del self.disagreeing[r.replica]
            self.log.info(
                "kv_replica_agrees",
                replica=r.replica,
                model=r.model,
                predicted=predicted,
                reported=reported,
            )

    def retain(self, live: set[str]) -> None:
        """Forget every replica not in ``live`` (gone: its heartbeats stopped)."""
        for name in set(self._judged) | set(self._loops) | set(self.incompatible):
            if name not in live:
                self.forget(name)

    def forget(self, replica: str) -> None:
        """A replica gone: nothing kept of it."""
        self.incompatible.pop(replica, None)
        self.disagreeing.pop(replica, None)
        self._judged.pop(replica, None)
        self._loops.pop(replica, None)

"""Which replica holds which prompt prefix in its KV cache, exactly: an index fed by the
replicas' own KV events (:mod:`bus_schemas.kv_events`).

Every router (and every bridge that routes in-process) keeps one. Per replica it holds the
set of cached block hashes (with their parents, for snapshots and eviction), and across
replicas an inverted map ``hash -> replicas holding it``. A lookup walks a request's chained
block hashes from the first: the replicas still holding block ``i`` are those that held every
block before it too (a chain whose middle block was evicted cannot be matched past it), so
each replica's cached prefix comes out of one pass of at most ``len(blocks)`` dict reads.

**Sequence and repair.** Each replica numbers its events from 1 per ``boot``. A batch that
does not start right after the last event applied (or a new ``boot``) means events were
missed: the replica is marked stale (its entries stay, still mostly right, but it is not
trusted for a new match until repaired) and the caller asks the replica for a snapshot
(:meth:`KVIndex.wants_snapshot`). Batches that arrive meanwhile are kept (bounded) and those
after the snapshot's ``seq`` are applied once it is loaded. A router that starts late asks
every replica it hears of for a snapshot, so it starts warm.

**Bounds.** A replica may hold at most ``max_blocks_per_replica`` entries (a bound on
memory, not its ``capacity_blocks``: a pool may hold more for a while); one that reports
more is cleared and resynchronised from a snapshot. A dead
replica's entries go with it (:meth:`drop`).
:meth:`stats` reports entries, an estimate of bytes, gaps and repairs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bus_schemas import kv_events as kv

# Bytes per indexed block, measured with tracemalloc on CPython 3.11 for u64 hashes: the
# replica's hash -> parent entry plus its share of the inverted map's entry and set.
BYTES_PER_ENTRY = 200
# Batches kept per replica while its snapshot is awaited.
MAX_PENDING_BATCHES = 256


@dataclass
class _Replica:
    """One replica's cache as this index knows it."""

    name: str
    boot: str = ""
    block_size: int = 0
    # How its engine hashes prompts (a snapshot's "hashing"; None: the sim's text scheme).
    hashing: dict[str, Any] | None = None
    seq: int = 0  # last event applied
    blocks: dict[Any, Any] = field(default_factory=dict)  # hash -> parent
    stale: bool = True  # not yet synchronised (no snapshot, or a gap since)
    pending: list[dict[str, Any]] = field(default_factory=list)
    asked_at: float = 0.0  # when a snapshot was last asked for (monotonic)
    last_event_ms: int = 0  # the replica's clock at its last batch
    last_event_at: float | None = None  # our monotonic clock at its last batch
    lag_ms: float = 0.0  # our clock minus the replica's at the last batch


class KVIndex:
    """Replicas' cached blocks, from their events; see the module docstring."""

    def __init__(self, max_blocks_per_replica: int = 1_000_000, resync_s: float = 2.0) -> None:
        self.max_blocks_per_replica = max_blocks_per_replica
        self.resync_s = resync_s
        self._replicas: dict[str, _Replica] = {}
        self._where: dict[Any, set[str]] = {}
        self.events_applied = 0
        self.gaps = 0
        self.repairs = 0
        self.lookups = 0
        # Routing decisions made on the index (KVAware.choose): how many, how many chose a
        # replica holding part of the prompt, and the prompt blocks cached there of all.
        self.decisions = 0
        self.hit_decisions = 0
        # predicted_latency's decisions made while every candidate was behind, a backlog and
        # long steps (scored by the prefill they make the fleet compute: kv.when_behind =
        # "work").
        self.behind_decisions = 0
        self.decided_blocks = 0
        self.decided_hit_blocks = 0
        # The closed loop (router.kv_check): replicas whose engines' reports disagree with
        # this index's predictions (replica -> why), routed by load until they agree; and
        # the seed of the sim's block hash this router computes.
        self.distrusted: dict[str, str] = {}
        self.text_seed = ""
        self.decided_predicted_tokens = 0

    # -- what a replica holds ----------------------------------------------------------------
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def synced(self, replica: str) -> bool:
        """Whether ``replica``'s entries are current (a snapshot loaded, no gap since)."""
        r = self._replicas.get(replica)
        return r is not None and not r.stale

    def block_size(self, replica: str) -> int:
        r = self._replicas.get(replica)
        return r.block_size if r is not None else 0

    def hashing(self, replica: str) -> dict[str, Any] | None:
        """How ``replica``'s engine hashes prompts, as its last snapshot said."""
        r = self._replicas.get(replica)
        return r.hashing if r is not None else None

    def held(self, replica: str) -> int:
        r = self._replicas.get(replica)
        return len(r.blocks) if r is not None else 0

    def last_event_at(self, replica: str) -> float | None:
        """When (monotonic) the last batch of ``replica`` arrived, or None."""
        r = self._replicas.get(replica)
        return r.last_event_at if r is not None else None

    def lookup(
        self, hashes: Sequence[Any], replicas: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Replica -> how many leading blocks of ``hashes`` it holds (only replicas that hold
        at least the first, among ``replicas`` when given, and only synchronised ones)."""
        self.lookups += 1
        if not hashes:
            return {}
        first = self._where.get(hashes[0])
        if not first:
            return {}
        alive = {n for n in first if not self._replicas[n].stale}
        if replicas is not None:
            alive &= set(replicas)
        depth: dict[str, int] = {}
        i = 0
        where = self._where
        while alive:
            i += 1
            for n in alive:
                depth[n] = i
            if i == len(hashes):
                break
            holders = where.get(hashes[i])
            if not holders:
                break
            alive = alive & holders
        return depth

    # -- events -----------------------------------------------------------------------------
    def apply(self, batch: dict[str, Any]) -> bool:
        """Apply a checked batch (:func:`kv_events.check_batch`); False when the replica
        needs a snapshot (a gap, a new boot, or none loaded yet: the batch is kept)."""
        name = batch["replica"]
        r = self._replicas.get(name)
        if r is None:
            r = self._replicas[name] = _Replica(name)
        r.last_event_ms = int(batch["ts_ms"])
        r.last_event_at = time.monotonic()
        r.lag_ms = max(0.0, time.time() * 1000 - r.last_event_ms)
        if r.stale:
            if len(r.pending) < MAX_PENDING_BATCHES:
                r.pending.append(batch)
            return False
        first, last = int(batch["seq_first"]), int(batch["seq_last"])
        if batch["boot"] != r.boot or first > r.seq + 1:
            self.gaps += 1
            r.stale = True
            r.pending = [batch]
            return False
        if last <= r.seq:
            return True  # seen already (a redelivery)
        skip = r.seq + 1 - first  # events of the batch already applied
        r.block_size = int(batch["block_size"])
        for ev in batch["events"][skip:]:
            self._apply_event(r, ev)
        r.seq = last
        return not r.stale

    def _apply_event(self, r: _Replica, ev: dict[str, Any]) -> None:
        self.events_applied += 1
        kind = ev["type"]
        name = r.name
        if kind == kv.STORED:
            parent = ev.get("parent")
            for h in ev["hashes"]:
                if h not in r.blocks:
                    self._where.setdefault(h, set()).add(name)
                r.blocks[h] = parent
                parent = h
            # Memory's bound, not the replica's capacity_blocks: a pool may hold more for a
            # while (the sim lends blocks past it), and a replica wrongly distrusted costs
            # every request routed to it its cache.
            if len(r.blocks) > self.max_blocks_per_replica:
                self._clear(r)  # more than it can hold: out of step, resynchronise
                r.stale = True
                self.gaps += 1
        elif kind == kv.REMOVED:
            for h in ev["hashes"]:
                if r.blocks.pop(h, _MISSING) is not _MISSING:
                    self._unwhere(h, name)
        else:
            self._clear(r)

    def _unwhere(self, h: Any, name: str) -> None:
        holders = self._where.get(h)
        if holders is not None:
            holders.discard(name)
            if not holders:
                del self._where[h]

    def _clear(self, r: _Replica) -> None:
        for h in r.blocks:
            self._unwhere(h, r.name)
        r.blocks.clear()

    # -- snapshots --------------------------------------------------------------------------
    def wants_snapshot(self, now: float | None = None) -> list[str]:
        """Stale replicas not asked for a snapshot in the last ``resync_s`` seconds (marked as
        asked now): the caller requests one from each."""
        now = time.monotonic() if now is None else now
        out = []
        for r in self._replicas.values():
            if r.stale and now - r.asked_at >= self.resync_s:
                r.asked_at = now
                out.append(r.name)
        return out

    def know(self, replica: str) -> None:
        """A replica heard of (a heartbeat): tracked, so a snapshot is asked for it."""
        if replica not in self._replicas:
            self._replicas[replica] = _Replica(replica)

    def load(self, snapshot: dict[str, Any]) -> None:
        """Replace a replica's entries with a whole (assembled, checked) snapshot, then apply
        the batches kept since that come after it."""
        name = snapshot["replica"]
        r = self._replicas.get(name)
        if r is None:
            r = self._replicas[name] = _Replica(name)
        self._clear(r)
        r.boot = snapshot["boot"]
        r.block_size = int(snapshot["block_size"])
        r.hashing = snapshot.get("hashing")
        r.seq = int(snapshot["seq"])
        for h, parent in snapshot["blocks"]:
            r.blocks[h] = parent
            self._where.setdefault(h, set()).add(name)
        r.stale = False
        self.repairs += 1
        pending, r.pending = r.pending, []
        for batch in sorted(pending, key=lambda b: int(b["seq_first"])):
            if batch["boot"] != r.boot or int(batch["seq_last"]) <= r.seq:
                continue  # in the snapshot already, or from another boot
            if int(batch["seq_first"]) > r.seq + 1:
                # A replica publishes its events before it answers a snapshot request, so a
                # batch kept meanwhile that does not follow on from the snapshot is not one
                # of its own: dropped, counted as a gap.
                self.gaps += 1
                continue
            self.apply(batch)

    def drop(self, replica: str) -> None:
        """Forget a replica (it died or left)."""
        r = self._replicas.pop(replica, None)
        if r is not None:
            self._clear(r)

    # -- account ----------------------------------------------------------------------------
    def trusted(self, replica: str) -> bool:
        """Whether routing may count on ``replica``'s entries (its engine's reports agree)."""
        return replica not in self.distrusted

    def decided(self, prompt_blocks: int, cached_blocks: int, predicted_tokens: int = 0) -> None:
        """Count a routing decision: the chosen replica holds ``cached_blocks`` of the
        prompt's ``prompt_blocks``, ``predicted_tokens`` prompt tokens to be read cached."""
        self.decisions += 1
        self.decided_predicted_tokens += predicted_tokens
        self.decided_blocks += prompt_blocks
        self.decided_hit_blocks += cached_blocks
        if cached_blocks:
            self.hit_decisions += 1

    def lags_s(self) -> dict[str, float]:
        """Per replica: our clock minus the replica's at its last batch (seconds)."""
        return {n: r.lag_ms / 1000.0 for n, r in self._replicas.items() if r.last_event_at}

    def entries_by_replica(self) -> dict[str, int]:
        return {n: len(r.blocks) for n, r in self._replicas.items()}

    def stats(self) -> dict[str, Any]:
        entries = sum(len(r.blocks) for r in self._replicas.values())
        return {
            "replicas": len(self._replicas),
            "synced": sum(1 for r in self._replicas.values() if not r.stale),
            "entries": entries,
            "distinct_blocks": len(self._where),
            "bytes_estimate": entries * BYTES_PER_ENTRY,
            "events_applied": self.events_applied,
            "gaps": self.gaps,
            "repairs": self.repairs,
            "lookups": self.lookups,
            "decisions": self.decisions,
            "hit_decisions": self.hit_decisions,
            "decided_hit_ratio": (
                round(self.decided_hit_blocks / self.decided_blocks, 4)
                if self.decided_blocks
                else None
            ),
            "lag_ms": {n: round(r.lag_ms, 1) for n, r in self._replicas.items()},
        }


_MISSING = object()

"""Routing policies: choose one replica among candidates."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.registry import Replica


def least_outstanding(candidates: Sequence[Replica]) -> Replica:
    """The replica with the fewest outstanding requests relative to its capacity; ties random."""
    best: list[Replica] = []
    best_load = float("inf")
    for r in candidates:
        load = r.load / r.max_concurrency
        if load < best_load:
            best, best_load = [r], load
        elif load == best_load:
            best.append(r)
    return best[0] if len(best) == 1 else random.choice(best)


POLICIES = {"least_outstanding": least_outstanding}

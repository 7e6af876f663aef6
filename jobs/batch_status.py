"""A batch's status and the changes it may make: the state machine of a batch's life.

Every change of a batch's status goes through :func:`transition`, checked against
:data:`TRANSITIONS` (docs/batches.md shows the same table). The changes in
:mod:`jobs.batches` and :mod:`jobs.batch_runner` ask :func:`allowed` first and change
nothing where it says no, so a change the table forbids is a bug here, never a client's
doing: it raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, cast, get_args

BatchStatus = Literal[
    "validating",
    "in_progress",
    "finalizing",
    "cancelling",
    "completed",
    "failed",
    "expired",
    "cancelled",
]
STATUSES: tuple[BatchStatus, ...] = get_args(BatchStatus)
# Not finished: a sweep still reads the batch, a runner may still change it.
OPEN: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")

# status -> the statuses it may change to. ``finalizing`` -> ``finalizing`` is a finalizer
# that stopped (``STALE_FINALIZING_S``) taken over by another runner.
TRANSITIONS: Mapping[BatchStatus, frozenset[BatchStatus]] = {
    "validating": frozenset({"in_progress", "cancelling", "failed"}),
    "in_progress": frozenset({"cancelling", "finalizing"}),
    "cancelling": frozenset({"finalizing", "failed"}),
    "finalizing": frozenset({"finalizing", "completed", "expired", "cancelled"}),
    "completed": frozenset(),
    "failed": frozenset(),
    "expired": frozenset(),
    "cancelled": frozenset(),
}


class ForbiddenTransition(RuntimeError):
    """A status change :data:`TRANSITIONS` does not allow (a bug: changes check first)."""


def allowed(status: str, to: BatchStatus) -> bool:
    """Whether a batch in ``status`` (as read: any string) may change to ``to``."""
    # A status read from the store is looked up as it is: one not in the table goes nowhere.
    return to in TRANSITIONS.get(cast(BatchStatus, status), frozenset())


def transition(status: str, to: BatchStatus) -> BatchStatus:
    """``to``, once :data:`TRANSITIONS` allows it from ``status``; raises otherwise."""
    if not allowed(status, to):
        raise ForbiddenTransition(f"a batch cannot go from {status!r} to {to!r}")
    return to

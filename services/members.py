"""Who of a queue group is alive, so that a request is not handed to a member that stalled.

NATS picks a member of a queue group at random, a paused or cut-off one included, until the
server drops its connection (seconds: ``services.natsconf.SERVER_TIMERS``). So every member
of the groups that carry requests (ingress, auth, ratelimit, filter, route) beats every
:data:`BEAT_S` on ``subjects.members(group)`` and also listens on a subject of its own
(``subjects.to_member``). Whoever sends to a group (callers, stages) follows the beats: while
every member it knows beats, it sends to the queue group as always; once one has missed
its beats (:data:`STALE_BEATS`), it sends to a member that beats instead, chosen at random.
A member that drains says so (``gone``) before it stops listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from services import natsclient

BEAT_S = 0.5
# A member not heard for this many beat intervals (while the bus is heard) is passed over.
STALE_BEATS = 2.4
# A member not heard for this long is forgotten (the server dropped it long before).
FORGET_S = 30.0


class Members:
    """What the beats say: per group, each member and when it was last heard."""

    def __init__(self, nc: NATS, groups: tuple[str, ...] | None = None) -> None:
        self.nc = nc
        # None: every group (a key's connection may follow only the ingress's).
        self.groups = groups
        self._seen: dict[str, dict[str, tuple[float, float]]] = {}
        self._subs: list[Any] = []

    async def start(self) -> None:
        wanted = (
            [subjects.members_wildcard()]
            if self.groups is None
            else [subjects.members(g) for g in self.groups]
        )
        for subject in wanted:
            self._subs.append(await natsclient.subscribe_direct(self.nc, subject, self._on_beat))

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _on_beat(self, msg: Msg) -> None:
        try:
            beat = codec.decode_map(msg.data)
            member = str(beat["id"])
            every = float(beat.get("every", BEAT_S))
            # A subject no member names (a forged token such as "~"): not a beat.
            group = subjects.untoken(msg.subject.rpartition(".")[2])
        except (E.TokenbusError, KeyError, TypeError, ValueError, RecursionError):
            return
        seen = self._seen.setdefault(group, {})
        if beat.get("gone"):
            seen.pop(member, None)
        else:
            seen[member] = (time.monotonic(), every)

    def live(self, group: str) -> tuple[list[str], int]:
        """(the members of ``group`` that beat, how many are known in all)."""
        seen = self._seen.get(group)
        if not seen:
            return [], 0
        now = time.monotonic()
        live = []
        for member, (at, every) in list(seen.items()):
            silent = natsclient.silent_for(self.nc, at, now)
            if silent <= every * STALE_BEATS:
                live.append(member)
            elif silent > FORGET_S:
                del seen[member]
        return live, len(seen)

    def known(self, subject: str) -> bool:
        """Whether a member of ``subject``'s queue group beat lately (within FORGET_S) and
        did not say it is gone: the group was there, so "no responders" may be a moment's
        (its connection coming back), not a stage nobody runs."""
        group = subjects.member_group(subject)
        return group is not None and bool(self._seen.get(group))

    def subject_for(self, subject: str) -> str:
        """Where to send a request for ``subject``: the subject itself (its queue group)
        while every known member beats or none does, else one member that beats."""
        group = subjects.member_group(subject)
        if group is None or group not in self._seen:
            return subject
        live, known = self.live(group)
        if not live or len(live) == known:
            return subject
        return subjects.to_member(random.choice(live), subject)

    def forget(self, sent_to: str) -> None:
        """A member's own subject had no responders (it stopped listening): pass it over."""
        parts = sent_to.split(".")
        if len(parts) > 3 and parts[2] == "to":
            group = subjects.member_group(f"{subjects.PREFIX}.{'.'.join(parts[4:])}")
            if group is not None:
                self._seen.get(group, {}).pop(subjects.untoken(parts[3]), None)


class Beat:
    """A member's beats for its groups, from its event loop (a stalled loop stops them)."""

    def __init__(self, nc: NATS, member: str, groups: list[str], every: float = BEAT_S) -> None:
        self.nc, self.member, self.groups, self.every = nc, member, groups, every
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        beat = codec.encode({"id": self.member, "every": self.every})
        while True:
            for group in self.groups:
                with contextlib.suppress(Exception):
                    await self.nc.publish(subjects.members(group), beat)
            await asyncio.sleep(self.every)

    async def gone(self) -> None:
        """Stop beating and tell the senders this member takes nothing more of its own."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        gone = codec.encode({"id": self.member, "gone": True})
        for group in self.groups:
            with contextlib.suppress(Exception):
                await self.nc.publish(subjects.members(group), gone)

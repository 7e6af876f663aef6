"""A worker's heartbeats: when it beats (at the full rate while it serves or drains, slower
when idle, at once when an idle replica takes a request), the host it says it runs on, and
the keepalive frames for the streams whose callers cannot see heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from bus_schemas import codec, frames, subjects
from engine_worker.replica import Replica
from services.config import Settings, read_login
from services.natsconf import WORKER_HOST_PREFIX

MAX_HOST = 255


def host_of(settings: Settings) -> str:
    """The host a replica's heartbeats name: ``worker.host`` where set; else the GPU host
    of its bus login (``worker-<host>``, the name the deployment gave the host, which the
    locked bus checked); else the machine's host name."""
    if settings.worker.host:
        return settings.worker.host[:MAX_HOST]
    user = settings.nats_user or ""
    if not user and settings.nats_login_file:
        with contextlib.suppress(OSError, ValueError, KeyError):
            user = read_login(settings.nats_login_file)["user"]
    if user.startswith(WORKER_HOST_PREFIX) and len(user) > len(WORKER_HOST_PREFIX):
        return user[len(WORKER_HOST_PREFIX) :][:MAX_HOST]
    return socket.gethostname()[:MAX_HOST]


class Heartbeats:
    """The beats of one replica; what a beat says is :meth:`Worker.heartbeat_body`."""

    def __init__(self, worker: Replica) -> None:
        self.w = worker
        self.host = host_of(worker.settings)
        self.seq = 0  # the beat's number
        self.busy = asyncio.Event()  # set when an idle replica takes a request: beat now
        # Streams whose callers cannot see heartbeats (Tb-Keepalive): reply -> None.
        self.keepalive: dict[str, None] = {}

    def interval(self) -> float:
        """Seconds to the next heartbeat: the full rate while any request is in flight (its
        caller watches the beats) or while draining, slower when idle."""
        cfg = self.w.cfg
        fast = float(cfg.heartbeat_interval_s)
        if self.w._active or self.w.draining:
            return fast
        return fast * float(cfg.idle_heartbeat_factor)

    async def beat(self) -> None:
        """Publish a heartbeat now."""
        w = self.w
        if w.failure is not None:  # given up (a second process of its id, or its engine
            return  # failed after its last beat said so): the id's beats are not its own
        with contextlib.suppress(Exception):
            await w.nc.publish(
                subjects.heartbeat(w.model, w.replica), codec.encode(w.heartbeat_body())
            )

    async def run(self) -> None:
        """Beat until cancelled; before each beat, check the engine's health."""
        w = self.w
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.busy.wait(), self.interval())
            self.busy.clear()
            await w.health.check()
            await self.beat()
            if self.keepalive:
                # Through the outbox: behind the chunks already queued for each stream.
                frame = frames.alive(w.boot, w.reconnects)
                for reply in list(self.keepalive):
                    w.outbox.send(reply, frame)

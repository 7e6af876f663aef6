"""The shared service runtime: connect, queue-group endpoints, one task per request,
deadlines, ``$SRV`` discovery, a canonical log line per request, graceful drain.

A service is one object used as an async context manager::

    async with Ingress(settings) as svc:
        await stop_event.wait()
    # leaving the block drains: stop taking work, finish in-flight, drain the connection
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import signal
import socket
import ssl
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import errors as E
from bus_schemas import frames, marks, subjects
from bus_schemas import headers as H
from services import logging as tlog
from services import natsclient, replies, tracing, usage
from services.config import Settings
from services.discovery import Discovery, EndpointStats
from services.endpoints import EndpointGroup, Handler
from services.members import Beat, Members

# How long a forwarded request's caller is remembered for a "no responders" bounce.
_BOUNCE_TTL_S = 10.0
# How long a forwarded request itself is kept to send again after a bounce (a bounce comes
# back within a round trip; a later one is answered 503 and the caller's own resend covers
# it): short, so that large bodies are not held for the whole bounce TTL.
_RESEND_KEEP_S = 2.0
# A stage's queue group with no responders, whose members beat lately, is tried again after
# these waits (s) before the caller is told the stage is absent: a stage whose connection
# comes back a moment after this service's own (both reconnecting after a pause of their
# nats-server) is not absent. Nothing was done with a request nobody received, so sending it
# again is safe. In all well under the caller's accept timeout (services/caller.py,
# ACCEPT_TIMEOUT_S 1.5 s), past which it would send the request again itself and miss the
# answer to this attempt. A stage that never beat is said absent at once.
_STAGE_RETRY_WAITS_S = (0.05, 0.1, 0.2, 0.4)
# A request a member has held this long without passing it on (a key check, a full queue)
# gets a hold frame on its stream, and one every as long again while held, so that its
# caller does not take it for lost (services/caller.py: ACCEPT_TIMEOUT_S).
_log = tlog.get("runtime")
HOLD_NOTICE_S = 0.5

VERSION = "0.1.0"

# What nats-py writes as a header name (an HTTP token). The server passes any bytes, so a
# message may name others; a stage forwarding its headers could then not publish at all.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A stage name from a routing slip: one subject token.
_STAGE_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")


def reply_subject(
    msg: Msg, *, trust_header: bool = True, service: str = "", log: Any = None
) -> str | None:
    """Where a request's frames go: the caller's inbox, carried in a header when the message
    itself was sent as a request (router -> worker). Ingress, which faces clients, does not
    trust that header. Only the requester's own inbox (:func:`services.replies.allowed`);
    None for any other subject, which is counted and logged once per sender."""
    hdrs = msg.headers
    r = (hdrs.get(H.REPLY_TO) if hdrs and trust_header else None) or msg.reply
    if not r:
        return None
    if replies.allowed(r, hdrs):
        return r
    replies.refused(service or "service", r, hdrs, log or _log)
    return None


async def flush(nc: NATS, timeout: int = 5) -> None:
    """A round trip to the server behind everything ``nc`` sent before: once it is back, the
    server has read (and routed) every earlier publish, subscribe and unsubscribe of ``nc``,
    and ``nc`` has read all the server sent it before.

    nats-py's ``flush()`` alone does not promise that: it writes its PING straight to the
    socket, ahead of the commands still queued for its flusher task, so the PONG can come
    back before the server has read them. So the queue is written out first (through
    nats-py's internal call for it; without that call, as nats-py's flush)."""
    write_queued = getattr(nc, "_flush_pending", None)
    if write_queued is not None and nc.is_connected:
        await asyncio.wait_for(write_queued(force_flush=True), timeout)
    await nc.flush(timeout)


async def _stop_interest(nc: NATS, sub: Any) -> None:
    """Send the server an UNSUB for ``sub`` while nats-py keeps delivering to it what the
    server routed to it before (nats-py has no public call for that: ``drain()`` also
    forgets the subscription once its own, possibly early, round trip is back)."""
    send = getattr(nc, "_send_unsubscribe", None)
    sid = getattr(sub, "_id", None)
    if send is not None and sid is not None:
        await send(sid)


def servers(url: str) -> list[str]:
    """A NATS URL, or several separated by commas (a cluster's nodes, the preferred first),
    as nats-py takes them. Connected to one node, a client also learns the cluster's other
    nodes and fails over to them."""
    return [u.strip() for u in url.split(",") if u.strip()]


class StartRefused(Exception):
    """A service cannot start as configured (its port is taken, its login refused, its
    upstream does not serve its model): retrying cannot help, so it exits with status 2."""


class GaveUp(Exception):
    """A running service stopped serving for good (:meth:`Service.give_up`): the process
    exits with ``exit_code`` (2: restarting it alone cannot help; others: restart it)."""

    def __init__(self, reason: str, exit_code: int = 2) -> None:
        super().__init__(reason)
        self.exit_code = exit_code


class ConnectRefused(StartRefused):
    """The NATS server refused this process's credentials at connect: retrying cannot help."""


def listen_socket(host: str, port: int, *, reuse_port: bool, what: str = "--port") -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (SO_REUSEPORT when ``reuse_port``,
    for several processes on one port), or :class:`StartRefused` saying why it cannot be:
    a port taken or not ours to bind is the operator's to fix, not a crash to retry."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(4096)
    except OSError as exc:
        sock.close()
        raise StartRefused(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}. Stop what runs there "
            f"or pick another port with {what}."
        ) from None
    return sock


def is_auth_error(exc: BaseException) -> bool:
    """Whether a connect error is the server refusing this login (or its TLS): final."""
    return (
        isinstance(exc, nats.errors.AuthorizationError)
        or "authorization violation" in str(exc).lower()
        # A TLS bus whose certificate this process does not trust, or that wants one from it.
        or isinstance(exc, ssl.SSLError)
    )


async def connect(
    url: str, name: str, on_reconnected: Callable[[], None] | None = None, **kw: Any
) -> NATS:
    """Connect with endless reconnects and logged connection events.

    A server that is not up yet is waited for; one that refuses the credentials at the
    first connect raises :class:`ConnectRefused` at once (nats-py would retry forever)."""
    log = tlog.get(name)
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[BaseException] = loop.create_future()
    connected = False

    async def on_disconnect() -> None:
        log.warning("nats_disconnected")

    async def on_reconnect() -> None:
        log.info("nats_reconnected")
        if on_reconnected is not None:
            on_reconnected()

    async def on_error(exc: Exception) -> None:
        if not connected and is_auth_error(exc):
            if not refused.done():
                refused.set_result(exc)
            return
        log.warning("nats_error", error=str(exc))

    attempt = asyncio.ensure_future(
        natsclient.connect(
            servers(url),
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            dont_randomize=True,  # the first URL is the preferred node; the rest are fallbacks
            connect_timeout=5,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            error_cb=on_error,
            pending_size=64 * 1024 * 1024,
            **kw,
        )
    )
    try:
        pending: set[asyncio.Future[Any]] = {attempt, refused}
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not attempt.done():
            attempt.cancel()
            with contextlib.suppress(BaseException):
                await attempt
    if attempt.done() and not attempt.cancelled() and attempt.exception() is None:
        connected = True
        return attempt.result()
    if refused.done():
        user = kw.get("user")
        who = f"user {user!r}" if user else "no credentials"
        if isinstance(refused.result(), ssl.SSLError):
            raise ConnectRefused(
                f"the TLS handshake with the NATS server at {url} failed for {name}: "
                f"{refused.result()}. Set TOKENBUS_NATS_TLS_CA to the bus's CA file (and, where "
                "the bus wants mutual TLS, TOKENBUS_NATS_TLS_CERT and TOKENBUS_NATS_TLS_KEY); "
                "`tokenbus nats-config --tls` wrote them and lists them in its tls.json."
            )
        raise ConnectRefused(
            f"the NATS server at {url} refused {name} ({who}): {refused.result()}. "
            "Beside a running `tokenbus up` the credentials are found in "
            "<data_dir>/nats-locked/nats-users.json; elsewhere set TOKENBUS_NATS_USER and "
            "TOKENBUS_NATS_PASSWORD (the role's password from that file)."
        )
    return attempt.result()  # raises the connect error


class HoldNotice:
    """While a request is held, a hold frame to its caller (``reply``: its inbox; None, no
    caller to tell) every :data:`HOLD_NOTICE_S`, until :meth:`cancel`."""

    __slots__ = ("nc", "reply", "sending", "timer")

    def __init__(self, nc: NATS, reply: str | None) -> None:
        self.nc = nc
        self.reply = reply
        self.sending: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        self.timer: asyncio.TimerHandle | None = (
            loop.call_later(HOLD_NOTICE_S, self._send) if self.reply else None
        )

    def _send(self) -> None:
        loop = asyncio.get_running_loop()
        self.sending = loop.create_task(self._publish())
        self.timer = loop.call_later(HOLD_NOTICE_S, self._send)

    async def _publish(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(str(self.reply), frames.HOLD_FRAME)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Service:
    """Base of every bus service; subclasses implement :meth:`setup` to add endpoints."""

    name = "service"
    description = ""
    # Whether the runtime drops expired messages before the handler sees them.
    check_deadline = True
    # Whether Tb-Reply-To may name the caller (false where clients publish directly).
    trust_reply_header = True
    # Whether it forwards requests to the next stage (:meth:`forward`), and so needs the
    # inbox where "no responders" come back; roles that never forward may not subscribe it.
    forwards = True
    # Whether a request this service ends with an error gives its rate-limit slot and token
    # reservation back (:mod:`services.usage`): true for every stage before the engine; the
    # worker reports what the engine used itself.
    releases_usage = True

    def __init__(self, settings: Settings, *, nc: NATS | None = None) -> None:
        self.settings = settings
        self.id = uuid.uuid4().hex[:12]
        self.reconnects = 0  # times the NATS connection came back after a break
        self.bounces = 0  # "no responders" answers to requests it forwarded
        self.nc: NATS = nc  # type: ignore[assignment]
        self._own_nc = nc is None
        self.log = tlog.get(self.name).bind(instance=self.id)
        self._tasks: set[asyncio.Task[None]] = set()
        self._subs: list[Any] = []
        self._accepting = False
        self.stopped = asyncio.Event()
        # Set by :meth:`give_up`: this process must not go on serving (it drains and exits
        # with the failure's status, the reason said).
        self.failure: GaveUp | None = None
        self._failed = asyncio.Event()
        # token -> (expiry, caller's inbox, subject, what to send to the queue group when it
        # went to one member whose own subject had no responders, and that subject)
        self._bounces: OrderedDict[
            str, tuple[float, str, str, tuple[bytes, dict[str, str], str] | None]
        ] = OrderedDict()
        # token -> (until, request, headers, tries so far): what a bounce from a stage's
        # queue group sends again (kept _RESEND_KEEP_S).
        self._resends: OrderedDict[str, tuple[float, bytes, dict[str, str], int]] = OrderedDict()
        # Who of the next stage's queue group beats (forwarders), and this instance's own
        # beats for the groups it is a member of (services/members.py).
        self.members: Members | None = None
        self._member_groups: list[str] = []
        self._beat: Beat | None = None
        self.discovery = Discovery(
            name=f"tokenbus-{self.name}",
            id=self.id,
            version=VERSION,
            description=self.description or (self.__doc__ or "").strip().split("\n")[0],
            metadata={"pid": str(os.getpid())},
        )

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect (unless given a connection), add endpoints, answer discovery."""
        if self.nc is None:
            self.nc = await self._connect()
        self._accepting = True
        if self.forwards:
            await self._open_bounce_inbox()
            self.members = Members(self.nc)
            await self.members.start()
        await self.setup()
        if self._member_groups:
            self._beat = Beat(self.nc, self.id, self._member_groups)
            self._beat.start()
        await self.discovery.start(self.nc)
        self._serve_metrics()
        # Subscriptions are only in effect once the server has them: until this round trip
        # a request could find "no responders" though the service says it has started.
        await flush(self.nc)
        self.log.info("service_started", nats=self.settings.url())

    def give_up(self, reason: str, exit_code: int = 2) -> None:
        """Stop serving for good: the process drains and exits with ``exit_code``, saying
        ``reason`` (2: what a supervisor cannot mend by restarting it alone)."""
        if self.failure is None:
            self.failure = GaveUp(reason, exit_code)
            self.log.error("service_giving_up", reason=reason, exit_code=exit_code)
            self._failed.set()

    def unhealthy(self) -> str | None:
        """Why this process should not be counted on though its loop and connection work
        (a worker whose engine died); None: healthy. Written to the health file."""
        return self.failure.args[0] if self.failure is not None else None

    async def _connect(self) -> NATS:
        """This service's own connection, named after the instance."""
        return await connect(
            self.settings.url(),
            f"tokenbus-{self.name}-{self.id}",
            on_reconnected=self.on_reconnected,
            **self.settings.nats_auth(),
        )

    async def _open_bounce_inbox(self) -> None:
        """Subscribe the inbox where "no responders" answers to :meth:`forward` arrive."""
        self._bounce_prefix = subjects.inbox_prefix(f"{self.name}-{self.id}")
        self._bounce_sub = await self.nc.subscribe(f"{self._bounce_prefix}.*", cb=self._on_bounce)

    def _serve_metrics(self) -> None:
        """Serve a scrape endpoint on the configured metrics port, if any."""
        if not self.settings.metrics_port:
            return
        # This process's own scrape endpoint (the default registry: process and
        # service metrics); the telemetry service serves the aggregate.
        from prometheus_client import start_http_server

        self._metrics_http = start_http_server(self.settings.metrics_port, addr="127.0.0.1")

    async def setup(self) -> None:
        """Add endpoints and start background tasks (subclasses)."""

    async def on_stop(self) -> None:
        """Called after in-flight work has finished or timed out (subclasses)."""

    # -- forwarding -----------------------------------------------------------------------
    async def forward(self, subject: str, data: bytes, hdrs: dict[str, str], reply: str) -> None:
        """Hand a request to the next stage, keeping the caller's inbox.

        The caller's inbox travels in ``Tb-Reply-To``; the message's own reply subject is
        this instance's bounce inbox, so when no instance of the next stage is subscribed,
        NATS answers "no responders" here and the caller gets a clear 503 instead of silence.
        """
        target = subject if self.members is None else self.members.subject_for(subject)
        hdrs[H.REPLY_TO] = reply
        # Sent to one member: should it have stopped listening, to the queue group after all.
        again = (data, dict(hdrs), target) if target != subject else None
        token = self._remember_caller(reply, subject, again)
        if again is None:
            self._keep_for_resend(token, data, dict(hdrs), 0)
        try:
            bounce = f"{self._bounce_prefix}.{token}"
            await self.nc.publish(target, data, reply=bounce, headers=hdrs)
        except nats.errors.MaxPayloadError:
            self._bounces.pop(token, None)
            self._resends.pop(token, None)
            raise E.PayloadTooLarge(
                "the request does not fit in one bus message with the stages' headers; "
                "send a smaller one"
            ) from None

    def _remember_caller(
        self, reply: str, subject: str, again: tuple[bytes, dict[str, str], str] | None = None
    ) -> str:
        """Keep ``reply`` for a bounce from ``subject`` under a new token, which is returned;
        forget entries past their time."""
        token = uuid.uuid4().hex
        now = time.monotonic()
        self._bounces[token] = (now + _BOUNCE_TTL_S, reply, subject, again)
        while self._bounces and next(iter(self._bounces.values()))[0] < now:
            self._bounces.popitem(last=False)
        return token

    def _keep_for_resend(self, token: str, data: bytes, hdrs: dict[str, str], tries: int) -> None:
        """Keep a request sent to a stage's queue group for a bounce's resend; forget those
        past :data:`_RESEND_KEEP_S`."""
        now = time.monotonic()
        self._resends[token] = (now + _RESEND_KEEP_S, data, hdrs, tries)
        while self._resends and next(iter(self._resends.values()))[0] < now:
            self._resends.popitem(last=False)

    async def _send_to_group(
        self, reply: str, subject: str, data: bytes, hdrs: dict[str, str], tries: int | None
    ) -> None:
        """Send a request again to ``subject``'s queue group, its bounce to this instance;
        ``tries``: the resends so far, kept for another (None: none after this one)."""
        token = self._remember_caller(reply, subject)
        if tries is not None:
            self._keep_for_resend(token, data, hdrs, tries)
        with contextlib.suppress(Exception):
            await self.nc.publish(
                subject, data, reply=f"{self._bounce_prefix}.{token}", headers=hdrs
            )

    async def _resend_to_stage(
        self, reply: str, subject: str, data: bytes, hdrs: dict[str, str], tries: int
    ) -> None:
        """After a bounce from ``subject``'s queue group, wait and send the request again."""
        await asyncio.sleep(_STAGE_RETRY_WAITS_S[tries])
        await self._send_to_group(reply, subject, data, hdrs, tries + 1)

    async def forward_next(self, msg: Msg, hdrs: dict[str, str], data: bytes) -> None:
        """Pass a request to the next stage of its routing slip (the router when none left)."""
        reply = reply_subject(
            msg, trust_header=self.trust_reply_header, service=self.name, log=self.log
        )
        if not reply:
            self.log.warning("request_without_reply_subject", subject=msg.subject)
            return
        nxt = _pop_next_stage(hdrs)
        if not _STAGE_NAME.fullmatch(nxt):
            raise E.InvalidRequest(f"the routing slip names no stage: {nxt[:64]!r}")
        marks.append(hdrs, self.name)
        await self.forward(subjects.stage(nxt), data, hdrs, reply)

    async def _on_bounce(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        entry = self._bounces.pop(token, None)
        if entry is None or not msg.headers or msg.headers.get(H.NATS_STATUS) != "503":
            return
        self.bounces += 1
        _, reply, subject, again = entry
        resend = self._resends.pop(token, None)
        if (
            resend is not None
            and resend[3] < len(_STAGE_RETRY_WAITS_S)
            and self.members is not None
            and self.members.known(subject)
        ):
            _, data, hdrs, tries = resend
            if not marks.expired(hdrs):
                task = asyncio.get_running_loop().create_task(
                    self._resend_to_stage(reply, subject, data, hdrs, tries)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return
        if again is not None:
            # One member's own subject: it stopped listening (drained). Its queue group.
            data, hdrs, member_subject = again
            if self.members is not None:
                self.members.forget(member_subject)
            await self._send_to_group(reply, subject, data, hdrs, None)
            return
        stage = subject.rpartition(".")[2]
        with contextlib.suppress(Exception):
            await self.nc.publish(
                reply,
                frames.error(
                    E.ServiceUnavailable(
                        f"no {stage} service is running on the bus; start one (`tokenbus serve "
                        f"{'router' if stage == subjects.STAGE_ROUTE else stage}`) and retry"
                    )
                ),
            )

    async def stop_taking_work(self) -> None:
        """Stop interest in every endpoint so queue-group peers get new requests; messages
        already delivered to this instance are still handled, never dropped.

        nats-py's ``Subscription.drain()`` alone is not enough: it forgets the subscription
        once a round trip is back, and that round trip can overtake its own UNSUB, so what
        the server routes here until it reads the UNSUB would be dropped unseen (its caller
        hears nothing until it resends or gives up). Hence: the UNSUBs, a round trip behind
        them (from then on the server routes nothing here, and all it routed here before has
        been read), then each subscription handles its queue and is dropped."""
        if self._beat is not None:
            # First: senders stop choosing this member by its own subject.
            await self._beat.gone()
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await _stop_interest(self.nc, sub)
        with contextlib.suppress(Exception):
            await flush(self.nc)
        for sub in subs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sub.drain(), 5.0)
        self._accepting = False

    async def drain(self, timeout: float | None = None) -> None:
        """Stop taking work, let in-flight requests finish up to ``timeout``, then drain."""
        timeout = self.settings.drain_timeout_s if timeout is None else timeout
        await self.stop_taking_work()
        await self._finish_in_flight(timeout)
        await self.on_stop()
        await self.discovery.stop()
        await self._close_bus()
        self.stopped.set()
        self.log.info("service_stopped")

    async def _finish_in_flight(self, timeout: float) -> None:
        """Wait up to ``timeout`` for running requests, then cancel the rest."""
        if not self._tasks:
            return
        self.log.info("draining", in_flight=len(self._tasks), timeout_s=timeout)
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        for t in pending:
            t.cancel()
        if pending:
            # A cancelled request still tells its caller to retry (see _run): give it time to.
            await asyncio.wait(pending, timeout=2.0)

    async def _close_bus(self) -> None:
        """Close the bounce inbox, then drain the connection if this service opened it."""
        if self.forwards:
            with contextlib.suppress(Exception):
                await self._bounce_sub.unsubscribe()
            if self.members is not None:
                await self.members.stop()
        if self._own_nc and self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), timeout=5.0)

    async def __aenter__(self) -> Service:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.drain()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    # -- endpoints ------------------------------------------------------------------------
    async def add_endpoint(
        self,
        name: str,
        subject: str,
        handler: Handler,
        *,
        queue: str | None = None,
        member: bool = False,
    ) -> None:
        """Subscribe ``handler``; every message runs in its own task. ``member``: requests
        with streams (ingress, stages) in ``queue``, which this instance beats for, also
        taken on its own subject, and told to their callers while held
        (services/members.py)."""
        stats = EndpointStats(name=name, subject=subject, queue_group=queue)
        self.discovery.endpoints.append(stats)
        holds = member

        def cb(msg: Msg) -> None:
            # From the connection's read loop (a direct subscription): the request's task
            # starts on the loop's next turn, not one turn later.
            work = (
                self._run(handler, msg, stats, holds)
                if self._accepting
                else self.reply_error(msg, self.interrupted_error())
            )
            task = asyncio.get_running_loop().create_task(work)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        sub = await natsclient.subscribe_direct(self.nc, subject, cb, queue=queue or "")
        self._subs.append(sub)
        if member and queue:
            own = subjects.to_member(self.id, subject)
            self._subs.append(await natsclient.subscribe_direct(self.nc, own, cb))
            if queue not in self._member_groups:
                self._member_groups.append(queue)

    def add_group(
        self,
        prefix: Callable[[str], str] | None = None,
        *,
        queue_group: str | None = None,
        member: bool = False,
    ) -> EndpointGroup:
        """Endpoints on ``prefix(name)`` in ``queue_group``, each added in one line."""
        return EndpointGroup(self.add_endpoint, prefix, queue_group=queue_group, member=member)

    def stage_endpoints(self, stage: str) -> EndpointGroup:
        """Pipeline stage ``stage``'s endpoints: on their stage subject, in its queue group,
        as its members."""
        return self.add_group(subjects.stage, queue_group=stage, member=True)

    async def _run(
        self, handler: Handler, msg: Msg, stats: EndpointStats, holds: bool = False
    ) -> None:
        """Handle one request: failures go back to the caller, the outcome into ``stats``."""
        t = time.perf_counter_ns()
        err: str | None = None
        hold = (
            HoldNotice(
                self.nc,
                reply_subject(
                    msg, trust_header=self.trust_reply_header, service=self.name, log=self.log
                ),
            )
            if holds
            else None
        )
        self._drop_unwritable_headers(msg)
        span = self._hop_span(msg) if tracing.on() else None
        token = tracing.activate(span)
        try:
            self._refuse_if_expired(msg)
            await handler(msg)
        except E.TokenbusError as exc:
            err = exc.code
            await self.reply_error(msg, exc)
            if self.releases_usage and msg.headers and H.RATELIMIT in msg.headers:
                # Admitted by a limiter, ended here before any engine ran it.
                await usage.report(self.nc, msg.headers, msg.headers.get(H.REQUEST_ID, ""))
        except asyncio.CancelledError:
            err = "cancelled"
            await self.reply_error(msg, self.interrupted_error())
            raise
        except Exception as exc:
            err = "internal_error"
            self.log.exception("handler_failed", error=str(exc))
            await self.reply_error(
                msg, E.InternalError(f"{self.name} failed to handle the request")
            )
        finally:
            if hold is not None:
                hold.cancel()
            stats.record(time.perf_counter_ns() - t, err)
            if span is not None:
                tracing.end(span, err)
                tracing.deactivate(token)

    def _hop_span(self, msg: Msg) -> Any:
        """This hop's span, the child of the traceparent ``msg`` carries (a root without
        one), made the parent of the next hop: the headers the handler forwards are copied
        from ``msg``'s, whose traceparent now names this span."""
        hdrs = msg.headers if msg.headers is not None else {}
        span = tracing.start(
            self.name,
            hdrs,
            kind=tracing.CONSUMER,
            attributes={
                tracing.STAGE: self.name,
                tracing.MESSAGING_SYSTEM: "nats",
                tracing.DESTINATION: msg.subject,
                tracing.REQUEST_ID: hdrs.get(H.REQUEST_ID),
                tracing.MODEL: hdrs.get(H.MODEL),
                tracing.KEY_ID: hdrs.get(H.PRINCIPAL),
            },
        )
        tracing.inject(span, hdrs)
        msg.headers = hdrs
        return span

    def _drop_unwritable_headers(self, msg: Msg) -> None:
        """Drop header names nats-py cannot write (the request goes on without them)."""
        hdrs = msg.headers
        if hdrs and not all(_HEADER_NAME.fullmatch(k) for k in hdrs):
            msg.headers = {k: v for k, v in hdrs.items() if _HEADER_NAME.fullmatch(k)}
            self.log.warning(
                "bad_header_names_dropped",
                subject=msg.subject,
                dropped=len(hdrs) - len(msg.headers),
            )

    def _refuse_if_expired(self, msg: Msg) -> None:
        """Raise :class:`E.Timeout` when ``msg``'s deadline passed (and this service checks)."""
        if self.check_deadline and marks.expired(msg.headers):
            raise E.Timeout("the request's deadline passed before it could be served")

    def interrupted_error(self) -> E.TokenbusError:
        """What a caller is told when a request is cut off by shutdown."""
        return E.ServiceUnavailable(f"the {self.name} instance stopped; retry")

    def on_reconnected(self) -> None:
        """The connection came back (possibly to another node): what was published just
        before the break may be lost. Counted; services that stream react."""
        self.reconnects += 1

    def _reply_of(self, msg: Msg) -> str | None:
        """Where this service answers ``msg``: its sender's own inbox (services.replies)."""
        return reply_subject(
            msg, trust_header=self.trust_reply_header, service=self.name, log=self.log
        )

    async def reply_error(self, msg: Msg, err: E.TokenbusError) -> None:
        """Send an error frame to the caller; never raises."""
        reply = reply_subject(
            msg, trust_header=self.trust_reply_header, service=self.name, log=self.log
        )
        if not reply:
            return
        with contextlib.suppress(Exception):
            await self.nc.publish(reply, frames.error(err))


def _pop_next_stage(hdrs: dict[str, str]) -> str:
    """Take the next stage off the routing slip in ``hdrs`` (the router when it is empty)."""
    route = [s for s in hdrs.get(H.ROUTE, "").split(",") if s]
    nxt = route.pop(0) if route else subjects.STAGE_ROUTE
    if route:
        hdrs[H.ROUTE] = ",".join(route)
    else:
        hdrs.pop(H.ROUTE, None)
    return nxt


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (Ctrl-C)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def cancel_and_wait(task: asyncio.Task[Any] | None, within_s: float = 5.0) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling it again while it runs on, for
    at most ``within_s``. Once is not always enough on Python 3.11: ``asyncio.wait_for``
    (under nats-py's ``fetch`` and ``next_msg``) returns its awaitable's result when that
    comes at the moment of the cancel, and the cancel is lost; a loop around such a call
    goes on, and an ``await task`` after one ``cancel()`` never returns (a bridge that
    never finished draining)."""
    if task is None:
        return
    give_up = time.monotonic() + within_s
    while not task.done():
        left = give_up - time.monotonic()
        if left <= 0:
            return
        task.cancel()
        await asyncio.wait([task], timeout=min(0.25, left))
    if not task.cancelled():
        task.exception()  # seen: an error it ended with is not logged as never retrieved


def dump_tasks(log: Any) -> None:
    """Every task on this process's loop and where it waits, to the log (``task_stack``
    lines; a service does this on SIGUSR1): what a process that does not finish draining,
    or stops answering while its loop still turns, is waiting on."""
    tasks = asyncio.all_tasks()
    for task in tasks:
        log.warning("task_stack", task=task.get_name(), of=len(tasks), stack=_awaiting(task))


def _awaiting(task: asyncio.Task[Any]) -> list[str]:
    """Where ``task`` waits: its chain of awaits, outermost first (``Task.get_stack`` gives
    a suspended coroutine's own frame only)."""
    out: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None and len(out) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            out.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_qualname}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out


def settle_heap() -> None:
    """Once a service has started: what it built so far (modules, models, settings, its
    connections: most of its objects, for good) goes out of the garbage collector's sight
    (``gc.freeze``). A full collection then walks only what came since, not every object
    imported. Each such pause lands on every request waiting on the process's loop: in
    ``tokenbus bench --batch-lines``'s interactive bridge, its full collections took up to
    231 ms (546 ms over the run) before, up to 58 ms (160 ms) after."""
    gc.collect()
    gc.freeze()


async def serve_until_signalled(service: Service) -> None:
    """Run ``service`` until SIGTERM/SIGINT, then drain it. A signal while it is still
    starting (waiting for NATS, loading an engine) stops it there."""
    # Tracing, when the OTEL_* environment asks for it: this process's spans are named after
    # the service; what is buffered is exported once the service has drained.
    tracing.setup(service.name, service.id)
    try:
        await _serve(service)
    finally:
        if tracing.on():
            await asyncio.to_thread(tracing.shutdown)


async def _serve(service: Service) -> None:
    stop = stop_event()
    # (before the start: the sim's engine-fault setting, for tests, takes SIGUSR1 over)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks, service.log)
    starting = asyncio.ensure_future(service.start())
    signalled = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        signalled.cancel()
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        if service.nc is not None:
            with contextlib.suppress(Exception):
                await service.nc.close()
        service.log.info("signal_received_while_starting")
        return
    starting.result()  # a failed start raises here
    settle_heap()
    if service.settings.loop_watchdog_s > 0:
        LoopWatchdog(service.settings.loop_watchdog_s).start()
    health = (
        asyncio.ensure_future(write_health(service, service.settings.health_file))
        if service.settings.health_file
        else None
    )
    failed = asyncio.ensure_future(service._failed.wait())
    signalled = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({failed, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if service.failure is None:
            service.log.info("signal_received")
    finally:
        failed.cancel()
        signalled.cancel()
        if health is not None:
            health.cancel()
        await service.drain()
    if service.failure is not None:
        raise service.failure


class LoopWatchdog:
    """Ends this process when its event loop has not turned for ``limit_s`` (a blocking
    call, a deadlock): from a thread of its own, which a stuck loop does not stop. Where a
    supervisor restarts what exits (compose's restart policy, systemd), the process comes
    back instead of holding its requests and its place in queue groups. A process that is
    paused whole (SIGSTOP, a frozen VM) cannot act on itself: ``tokenbus up``'s supervisor
    and Kubernetes' liveness probes handle that."""

    EXIT_CODE = 70

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.turned = time.monotonic()

    def start(self) -> None:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self.turned = time.monotonic()
            loop.call_later(min(1.0, self.limit_s / 4), tick)

        tick()
        threading.Thread(target=self._watch, name="loop-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.limit_s / 4))
            stuck = time.monotonic() - self.turned
            if stuck > self.limit_s:
                # The loop cannot log; stderr is written from this thread, then the exit.
                os.write(
                    2,
                    json.dumps(
                        {"event": "event_loop_stuck", "stuck_s": round(stuck, 1), "exit": 70}
                    ).encode()
                    + b"\n",
                )
                os._exit(self.EXIT_CODE)


HEALTH_EVERY_S = 2.0


async def write_health(service: Service, path: str) -> None:
    """Every :data:`HEALTH_EVERY_S`, after a round trip to the NATS server, write ``path``:
    this process's loop runs and its connection works (``tokenbus health --file`` reads it;
    a container health check cannot reach the service through the bus with its role's
    permissions, and most services serve no HTTP)."""
    tmp = f"{path}.tmp"
    while True:
        connected = False
        if service.nc is not None and service.nc.is_connected:
            try:
                await service.nc.flush(timeout=int(HEALTH_EVERY_S))
                connected = True
            except Exception:  # timed out or dropped: not healthy this round
                connected = False
        state = {
            "service": service.name,
            "id": service.id,
            "ts": time.time(),
            "connected": connected,
            "accepting": service._accepting,
            "unhealthy": service.unhealthy(),
        }
        try:
            with open(tmp, "w") as fh:
                json.dump(state, fh)
            os.replace(tmp, path)
        except OSError as exc:
            service.log.warning("health_file_not_written", path=path, error=str(exc))
        await asyncio.sleep(HEALTH_EVERY_S)


def check_health(path: str, max_age_s: float) -> str | None:
    """Why the service writing ``path`` is unhealthy (None: healthy)."""
    try:
        with open(path) as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:
        return f"no health file {path}: {exc}"
    age = time.time() - float(state.get("ts", 0))
    if age > max_age_s:
        return f"health file {age:.0f} s old (the service's loop is stuck or it has stopped)"
    if not state.get("connected"):
        return "not connected to NATS"
    if state.get("unhealthy"):
        return str(state["unhealthy"])
    return None


def run(coro: Awaitable[None]) -> None:
    """Run under uvloop when available."""
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]

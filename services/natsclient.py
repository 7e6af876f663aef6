"""nats-py's client, kept connected whatever one message holds.

nats-py (2.16) stops reading a connection for good when it fails on one incoming message:
its read loop ends on any exception, and nothing reconnects. Two messages any role may send
do that: one on a subject that is not UTF-8 (``tb.v1.req.\\xff`` reaches ingress' ``req.*``
subscription), and one whose header block starts with a status (``NATS/1.0 503``) followed by
bytes that are not UTF-8. The process would stay up, deaf to the bus. Here such text is
decoded with replacement characters, and a message that still fails is dropped and reported
to the connection's error callback, so the connection goes on reading.

nats-py also splits the server's ``MSG`` lines on any whitespace where the server separates
fields by spaces and tabs only: a subject holding a form feed or a vertical tab (which the
server passes) misparses, and nats-py drops the connection and reconnects, losing what was in
flight. The patterns are patched here (for every nats-py connection of the process) to split
as the server does.

Going out, the server closes the connection of a client that sends a command line longer
than 4 KiB (a subject taken from a message: a reply inbox, a replica's name) or headers and
payload together over ``max_payload`` (nats-py checks the payload alone). Such a publish is
refused here with nats-py's own error instead, before it is written.

Hot subscriptions (service endpoints, a caller's inbox) can skip nats-py's queue and task
per subscription: :func:`subscribe_direct` calls back from the connection's read loop, one
event-loop turn sooner per hop.

A login the server refuses is retried by nats-py for ever, at first connect and at every
reconnect, with a traceback each time. Where the refusal is final (``connect(...,
refusal_is_final=True)``: a tokenbus client logging in with its API key), the first connect
raises :class:`LoginRefused` at once, and a connection whose login is refused on a reconnect
(its key revoked while connected: the server kicks it, the reconnect is refused) is closed
instead, with :attr:`Client.refused` saying why; neither goes to the error callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from nats import errors
from nats.aio.client import Client as NATS
from nats.aio.client import _default_error_callback
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext
from nats.protocol import parser

# The NATS server's default ``max_control_line``: ``HPUB <subject> <reply> <sizes>`` must fit.
MAX_CONTROL_LINE = 4096

# How often a connection pings its server, and how many pings may go unanswered before it
# takes the server for gone and moves to another one (nats-py's defaults, 120 s and 2, let a
# server that stalls with its sockets open go unnoticed for about four minutes). With these,
# a silent server is noticed 2 to 3 s after its last answer (docs/fault-tolerance.md). The
# environment (``TOKENBUS_NATS_PING_INTERVAL_S``, ``TOKENBUS_NATS_PINGS_OUTSTANDING``) and the
# ``connect`` options override them.
PING_INTERVAL_S = 1.0
PINGS_OUTSTANDING = 2


def ping_options() -> dict[str, Any]:
    """The ping options of every tokenbus connection (see :data:`PING_INTERVAL_S`)."""
    return {
        "ping_interval": float(os.environ.get("TOKENBUS_NATS_PING_INTERVAL_S") or PING_INTERVAL_S),
        "max_outstanding_pings": int(
            os.environ.get("TOKENBUS_NATS_PINGS_OUTSTANDING") or PINGS_OUTSTANDING
        ),
    }


# nats-py's own patterns (the same groups), with the server's separators instead of ``\s``.
parser.MSG_RE = re.compile(
    rb"\AMSG[ \t]+([^ \t\r\n]+)[ \t]+([^ \t\r\n]+)[ \t]+(([^ \t\r\n]+)[ \t]+)?(\d+)\r\n"
)
parser.HMSG_RE = re.compile(
    rb"\AHMSG[ \t]+([^ \t\r\n]+)[ \t]+([^ \t\r\n]+)[ \t]+(([^ \t\r\n]+)[ \t]+)?"
    rb"(\d+)[ \t]+(\d+)\r\n"
)


_FC_IDLE_CHECK_S = 30.0


def _flow_control_on_demand() -> None:
    """nats-py's ordered consumers (every KV watch: key revocations, the routing table) poll
    four times a second, for the life of the watch, whether a flow-control reply is owed. That
    poll is most of what an idle service does. Here the loop sleeps until the server asks for
    flow control, then answers it as nats-py does (publishing the reply once the messages
    before it have been taken, checking every 0.25 s meanwhile). Left as it is when a nats-py
    release no longer has the pieces this relies on."""
    jsi = getattr(JetStreamContext, "_JSI", None)
    schedule = getattr(jsi, "schedule_flow_control_response", None)
    if jsi is None or schedule is None or not hasattr(jsi, "check_flow_control_response"):
        return

    def schedule_flow_control_response(self: Any, reply: str) -> None:
        schedule(self, reply)
        owed = getattr(self, "_tb_fc_owed", None)
        if owed is not None:
            owed.set()

    async def check_flow_control_response(self: Any) -> None:
        owed = self._tb_fc_owed = asyncio.Event()
        if self._fcr:
            owed.set()
        while not self._conn.is_closed:
            if not self._fcr:
                owed.clear()
                # Woken by an ask; the timeout only notices a closed connection (nats-py
                # cancels this task when the watch stops) without waking every 0.25 s.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(owed.wait(), _FC_IDLE_CHECK_S)
                continue
            if (self._fciseq - self._psub._pending_queue.qsize()) >= self._fcd:
                fc_reply = self._fcr
                with contextlib.suppress(Exception):
                    await self._conn.publish(fc_reply)
                self._fcr = None
                self._fcd = 0
                continue
            await asyncio.sleep(0.25)

    jsi.schedule_flow_control_response = schedule_flow_control_response
    jsi.check_flow_control_response = check_flow_control_response


_flow_control_on_demand()


# What nats-server says when it refuses a login, or ends one (lower case): a wrong or revoked
# credential, an expired or revoked user JWT (the auth callout's answer).
_REFUSALS = (
    "authorization violation",
    "authentication expired",
    "authentication revoked",
)


def is_login_refusal(exc: BaseException | str) -> bool:
    """Whether ``exc`` (an error of nats-py, or the server's ``-ERR`` text) is the server
    refusing this connection's login, which no retry changes."""
    if isinstance(exc, errors.AuthorizationError):
        return True
    text = str(exc).lower()
    return any(r in text for r in _REFUSALS)


class LoginRefused(Exception):
    """The NATS server refused the login at the first connect, where the refusal is final
    (``connect(..., refusal_is_final=True)``); the message is the server's."""


def _utf8(raw: bytes) -> bytes:
    """``raw`` with what is not UTF-8 replaced (U+FFFD)."""
    if raw.isascii():
        return raw
    return raw.decode("utf-8", "replace").encode()


# How long after a server was unreachable a refused login on a reconnect is taken for the
# auth service not being back yet rather than for the key (services reconnect within about
# a second of a restarted server; see Client._server_returning).
REFUSAL_GRACE_S = 10.0


def _fits_control_line(subject: str, reply: str = "") -> bool:
    """Whether a PUB of ``subject`` (and ``reply``) fits the server's control line."""
    return len(subject.encode()) + len(reply.encode()) + 64 <= MAX_CONTROL_LINE


class _Buffer(bytearray):
    """nats-py's parse buffer, whose slices come out as bytes in one copy. nats-py takes each
    message's payload as ``bytes(buf[a:b])``: a bytearray slice, then a copy of it. Here the
    slice is bytes already, which ``bytes()`` returns as it is: a 4 MiB body arriving in
    64 KiB messages is 4 MiB less to copy in the replica that reads it."""

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, slice):
            return super().__getitem__(key)
        view = memoryview(self)
        try:
            return view[key].tobytes()
        finally:
            view.release()  # the buffer may be resized again (del, extend) once it is read


class _Parser(parser.Parser):
    """nats-py's parser over a :class:`_Buffer`."""

    def reset(self) -> None:
        super().reset()
        self.buf = _Buffer()


class Client(NATS):
    """A nats-py client that one malformed message cannot stop, with direct subscriptions
    (:func:`subscribe_direct`)."""

    def __init__(self) -> None:
        super().__init__()
        self._ps = _Parser(self)
        # Subscription id -> the callback its messages go to from the read loop.
        self._direct: dict[int, Callable[[Msg], None]] = {}
        self._write_next = False  # the next publish goes to the socket at once (request)
        # Whether a refused login ends the connection instead of being retried, and the
        # server's refusal once it came (the connection is then closed for good).
        self.refusal_is_final = False
        self.refused: Exception | None = None
        # When a server was last unreachable or left a login unanswered: a login refused soon
        # after (the server is back, the auth service that answers its logins is not yet, or
        # its key store is still loading) is no verdict on the key.
        self.refusal_grace_s = REFUSAL_GRACE_S
        self.unreachable_at = -1e9  # never yet
        self.refusals_forgiven = 0  # logins refused and tried again (not taken as final)
        self.logged_in = False  # once: a later refusal is on a reconnect
        # The id of the server process this client last logged in to: a refusal by another
        # one (restarted, or another node) comes from a server that just came back.
        self._logged_server = ""
        self._graced_server = ""  # the other server whose refusals the grace started at
        # When the server was last heard (a message, a ping's answer, a login), and when it
        # was heard again after a silence: see :func:`silent_for`.
        self.heard_at = time.monotonic()
        self.resumed_at = -1e9  # never yet
        # When the connection was dropped for a server that stopped answering (None: it
        # was not, or a server refused a connection since): see :meth:`stalled`.
        self.stalled_at: float | None = None
        # Silence longer than this (one and a half ping intervals: the server answers each
        # ping at once) was a quiet server; set at login, from the ping option.
        self._quiet_s = 0.0

    def _heard(self) -> None:
        """Called for every message and ping answer (the read loop's hot path): a reconnect
        marks ``resumed_at`` itself (:meth:`_process_connect_init`)."""
        now = time.monotonic()
        if now - self.heard_at > self._quiet_s:
            self.resumed_at = now
        self.heard_at = now

    async def _process_pong(self) -> None:
        self._heard()
        await super()._process_pong()

    async def _ping_interval(self) -> None:
        """Ping the server every ping interval; take it for gone when more pings than
        allowed are unanswered. Unlike nats-py's loop, a ping never waits for the writer:
        behind a socket that takes nothing (a partition under load: the kernel's buffer
        full, nothing reset) nats-py's flush queue fills, its ping loop waits on it for
        ever, and the dead server is never noticed."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.options["ping_interval"])
            if not self.is_connected or self._transport is None:
                continue
            self._pings_outstanding += 1
            if self._pings_outstanding > self.options["max_outstanding_pings"]:
                await self._process_op_err(errors.StaleConnectionError())
                return
            self._pongs.append(loop.create_future())
            self._transport.write(b"PING\r\n")
            with contextlib.suppress(asyncio.QueueFull):
                self._flush_queue.put_nowait(loop.create_future())  # type: ignore[union-attr]

    async def _connect_to_server(self, s: Any) -> None:
        try:
            await super()._connect_to_server(s)
        except (OSError, TimeoutError) as exc:
            self.unreachable_at = time.monotonic()
            if isinstance(exc, ConnectionRefusedError):
                self.stalled_at = None  # nobody listens there: down, not stalled
            raise
        # A socket that connects is no sign the stall is over: a paused nats-server's
        # kernel still accepts connections into its listen queue, and nothing answers
        # them. Only a login that completes ends it (:meth:`_process_connect_init`).

    def stalled(self) -> bool:
        """Whether this connection is down because its server stopped answering (pings
        unanswered) and no server has refused a connection since: a stall, which usually
        ends (a paused VM, a partition healing), not a server that is gone."""
        return self.stalled_at is not None and not self.is_connected

    async def _process_connect_init(self) -> None:
        try:
            await super()._process_connect_init()
        except Exception as exc:
            if not is_login_refusal(exc) or self._new_server_refused():
                # No answer to the login (a restarted server whose auth service is not back
                # answers none in time), or a refusal by a server process other than the one
                # last logged in to (restarted faster than the reconnect wait, so never
                # unreachable): the server is not ready yet, no verdict on the key.
                self.unreachable_at = time.monotonic()
            elif self.refusal_is_final and not self._server_returning():
                self.refused = exc
            if self.refused is None and is_login_refusal(exc):
                self.refusals_forgiven += 1
            raise
        self._quiet_s = 1.5 * float(self.options.get("ping_interval") or 0)
        self.stalled_at = None
        self.heard_at = time.monotonic()
        if self.logged_in:  # a reconnect: the bus is heard again
            self.resumed_at = self.heard_at
        self.logged_in = True
        self._logged_server = str(self._server_info.get("server_id") or "")

    def _new_server_refused(self) -> bool:
        """Whether this is the first refusal by a server process other than the one last
        logged in to (its INFO's ``server_id``; a kicked connection reconnects to the same
        one): the grace starts there, once, so a key really revoked is still refused for
        good when it is over."""
        now = str(self._server_info.get("server_id") or "")
        if not (self.logged_in and now and now != self._logged_server):
            return False
        if now == self._graced_server:
            return False
        self._graced_server = now
        return True

    def _server_returning(self) -> bool:
        """Whether this is a reconnect to a server that was unreachable moments ago (it
        restarted): the services that answer its logins reconnect too, and until they do
        every login is refused; nats-py tries again, and a key really revoked is refused
        again once the grace is over."""
        # nats-py is CONNECTING, not RECONNECTING, while it logs in again: it logged in before.
        return self.logged_in and time.monotonic() - self.unreachable_at < self.refusal_grace_s

    async def _select_next_server(self) -> None:
        # nats-py's loops (first connect, reconnect) come back here for the next try after a
        # failed one; after a refused login there is none. At the first connect this leaves
        # ``connect()``; on a reconnect, "no servers" closes the connection (callbacks run).
        if self.refused is not None:
            if self.is_reconnecting:
                # What waits to be written goes nowhere now; nats-py's close would write it
                # to the refused socket, fail, and never finish (no closed callback).
                self._pending = []
                self._pending_data_size = 0
                raise errors.NoServersError
            raise LoginRefused(str(self.refused))
        await super()._select_next_server()

    async def _process_op_err(self, e: Exception) -> None:
        # The server ended a connection that was up: where a refusal is final (a key's
        # connection, kicked when its key is revoked), the first reconnect goes at once, so
        # the refusal is known now, not after nats-py's wait between attempts to one server.
        if self.refusal_is_final and self.is_connected and self._current_server is not None:
            self._current_server.last_attempt = None
        if isinstance(e, errors.StaleConnectionError) and self.is_connected:
            self.stalled_at = time.monotonic()
            self._abort_socket()
        await super()._process_op_err(e)

    def _abort_socket(self) -> None:
        """Drop the socket of a server that stopped answering at once. nats-py closes it
        and waits until it is closed, and a socket closes only once what it holds is sent:
        to a server cut off (a partition, nothing reset) with unsent data, that wait lasts
        until TCP gives up, minutes, and the reconnect waits with it."""
        writer = getattr(self._transport, "_io_writer", None)
        sock = getattr(writer, "transport", None)
        if sock is not None:
            with contextlib.suppress(Exception):
                sock.abort()

    async def _process_err(self, err_msg: str) -> None:
        # A login ended while connected (its user JWT expired): nats-py closes the connection.
        if self.refusal_is_final and is_login_refusal(err_msg):
            self.refused = errors.Error(f"nats: {err_msg.strip()}")
        await super()._process_err(err_msg)

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._direct.pop(sid, None)
        super()._remove_sub(sid, max_msgs)

    async def _process_headers(self, headers: bytes) -> dict[str, str] | None:
        try:
            out: dict[str, str] | None = await super()._process_headers(headers)
        except UnicodeDecodeError:  # a status line's description is decoded strictly
            out = await super()._process_headers(_utf8(bytes(headers)))
        return out

    def _build_message(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: Any
    ) -> Any:
        return super()._build_message(sid, _utf8(subject), _utf8(reply), data, headers)

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        if not _fits_control_line(subject, reply):
            raise errors.BadSubjectError
        if headers:
            size = sum(len(k) + len(v.encode()) + 4 for k, v in headers.items()) + 12
            if size + len(payload) > self.max_payload:
                raise errors.MaxPayloadError
        await super().publish(subject, payload, reply, headers)

    async def _send_publish(
        self,
        subject: str,
        reply: str,
        payload: bytes,
        payload_size: int,
        headers: dict[str, Any] | None,
    ) -> None:
        await super()._send_publish(subject, reply, payload, payload_size, headers)
        if self._write_next:
            self._write_next = False
            self._write_pending()

    def _write_pending(self) -> None:
        """Hand what is queued for the server to the socket now (the flusher task, on its
        next turn, then finds nothing to write); order is kept, as everything queued goes."""
        if self._pending_data_size and self.is_connected and self._transport is not None:
            self._transport.writelines(self._pending[:])
            self._pending = []
            self._pending_data_size = 0

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        self._heard()
        try:
            fn = self._direct.get(sid)
            if fn is None:
                await super()._process_msg(sid, subject, reply, data, headers)
                return
            self.stats["in_msgs"] += 1
            self.stats["in_bytes"] += len(data)
            if sid not in self._subs:
                return
            hdr = await self._process_headers(headers)
            msg = self._build_message(sid, subject, reply, data, hdr)
            if msg:
                fn(msg)
        except Exception as exc:  # dropped: reading on matters more than this message
            await self._error_cb(exc)


def outage_wait(nc: Any, down: float, stalled: float) -> float:
    """How long a request waits for ``nc`` to be connected again: ``stalled`` seconds when
    its server stopped answering (:meth:`Client.stalled`: it likely comes back), ``down``
    when it is gone (refused, closed)."""
    return stalled if isinstance(nc, Client) and nc.stalled() else down


def resumed_within(nc: Any, seconds: float) -> bool:
    """Whether ``nc``'s server was heard again after a silence (or the connection came
    up) less than ``seconds`` ago: the others' connections may still be coming back."""
    return isinstance(nc, Client) and time.monotonic() - nc.resumed_at < seconds


# The longest silence of the bus that is not counted against others: a quiet server this
# connection is still connected to (its pings drop the connection within a few seconds,
# and then it is a stall), and the server gone (refused or closed the connection: a restart
# usually comes back within seconds). Past it silence counts again, so nothing waits on a
# bus that does not come back. A stall (the connection dropped for a server that stopped
# answering, and no login since) counts none at all: a paused server or a partition that
# heals finds every stream where it was, and what bounds the wait is each request's own
# deadline (issue 65).
STALL_GRACE_S = 15.0
DOWN_GRACE_S = 5.0


def silent_for(nc: Any, t: float, now: float) -> float:
    """How long someone last heard at ``t`` (a replica's heartbeat) has been silent while
    the bus was heard: to when the server was last heard (a message, a ping's answer: at
    least once a ping interval; at most :data:`STALL_GRACE_S`, or :data:`DOWN_GRACE_S` for a
    server gone, back; no limit during a stall), from when it was heard again after a
    silence. A stalled or
    restarting server, or this connection reconnecting, is not everyone else dying at once;
    when the server is heard, whoever is late is late. On a connection that is not
    :class:`Client`, ``now - t``."""
    if not isinstance(nc, Client):
        return now - t
    if nc.stalled():
        end = min(now, nc.heard_at)
    else:
        grace = STALL_GRACE_S if nc.is_connected else DOWN_GRACE_S
        end = min(now, max(nc.heard_at, now - grace))
    return max(0.0, end - max(t, nc.resumed_at))


async def subscribe_direct(
    nc: NATS, subject: str, fn: Callable[[Msg], None], *, queue: str = ""
) -> Subscription:
    """Subscribe ``fn``, called for each message, in order, from the connection's read loop.

    nats-py hands a subscription's messages to a task of its own through a queue, so each
    one waits a turn of the event loop before its callback runs; on a busy loop that turn is
    the time one burst of tokens takes. ``fn`` must not block and must be quick (it creates
    a task for anything longer); what it raises goes to the connection's error callback. On
    a connection that is not :class:`Client`, ``fn`` runs from an ordinary subscription."""
    if isinstance(nc, Client):
        sub = await nc.subscribe(subject, queue=queue)
        nc._direct[sub._id] = fn
        return sub

    async def cb(msg: Msg) -> None:
        fn(msg)

    return await nc.subscribe(
        subject,
        queue=queue,
        cb=cb,
        pending_msgs_limit=1_000_000,
        pending_bytes_limit=512 * 1024 * 1024,
    )


async def request(
    nc: NATS,
    subject: str,
    payload: bytes,
    *,
    timeout: float,
    headers: dict[str, str],
    at_once: bool = False,
) -> Msg:
    """``nc.request()``; with ``at_once``, its message is written to the socket at once.

    nats-py queues a publish for its flusher task, which writes on a later turn of the event
    loop: after every task already waiting to run. When a burst of requests arrives
    together (an HTTP bridge admitting many clients at once), each one's message would wait
    until the whole burst is admitted, and the replica would start none of them before it
    starts them all. Written at once, the replica works on the first while this process
    admits the rest. On a connection that is not :class:`Client`, always a plain request."""
    with _writing_at_once(nc, at_once):
        return await nc.request(subject, payload, timeout=timeout, headers=headers)


async def publish_at_once(
    nc: NATS, subject: str, payload: bytes, headers: dict[str, str] | None = None
) -> None:
    """``nc.publish()``, its message written to the socket at once rather than on the
    flusher's next turn (:func:`request`'s ``at_once``): a run of large messages (a body's
    chunks) starts crossing the bus with the first instead of after the last is queued. On a
    connection that is not :class:`Client`, a plain publish."""
    with _writing_at_once(nc):
        await nc.publish(subject, payload, headers=headers)


async def publish_all_at_once(nc: NATS, messages: Sequence[tuple[str, bytes]]) -> None:
    """Publish ``messages`` (subject, payload: no reply, no headers), in order, written to
    the socket at once and in one write, their payloads as they are. nats-py copies each
    payload into its command and queues it for the flusher: for a 4 MiB body sent in
    64 KiB messages that was 4 MiB copied and about 1 ms more of the event loop on the
    request's path (docs/large-requests.md). What was queued before goes first. On a
    connection that is not :class:`Client`, or not connected (nats-py keeps what is
    published while it reconnects), one :meth:`publish` each."""
    transport = getattr(nc, "_transport", None)
    if not (isinstance(nc, Client) and nc.is_connected and transport is not None):
        for subject, payload in messages:
            await nc.publish(subject, payload)
        return
    parts: list[bytes] = []
    size = 0
    for subject, payload in messages:
        if not _fits_control_line(subject) or not subject or _SPACE.search(subject):
            raise errors.BadSubjectError
        if len(payload) > nc.max_payload:
            raise errors.MaxPayloadError
        parts += (b"PUB %s %d\r\n" % (subject.encode(), len(payload)), payload, b"\r\n")
        size += len(payload)
    nc._write_pending()
    nc.stats["out_msgs"] += len(messages)
    nc.stats["out_bytes"] += size
    transport.writelines(parts)


# What may not be in a subject (it would end the command's field).
_SPACE = re.compile(r"\s")


@contextlib.contextmanager
def _writing_at_once(nc: NATS, at_once: bool = True) -> Iterator[None]:
    """While it lasts, ``nc``'s next publish goes to the socket at once (:class:`Client`
    only; on another connection, or without ``at_once``, nothing changes)."""
    if not (at_once and isinstance(nc, Client)):
        yield
        return
    nc._write_next = True
    try:
        yield
    finally:
        nc._write_next = False


async def connect(
    servers: str | list[str], *, refusal_is_final: bool = False, **options: Any
) -> NATS:
    """``nats.connect()`` with :class:`Client`. ``refusal_is_final``: a login the server
    refuses raises :class:`LoginRefused` at once (nats-py would try again for ever, or
    raise its own error without reconnects), and one refused on a reconnect closes the
    connection (:attr:`Client.refused`)."""
    nc = Client()
    nc.refusal_is_final = refusal_is_final
    for k, v in ping_options().items():
        options.setdefault(k, v)
    if refusal_is_final:
        theirs = options.get("error_cb") or _default_error_callback

        async def on_error(exc: Exception) -> None:
            # The refusal is raised (or kept in ``refused``), not reported too; what follows
            # it (the server resetting the refused socket) is no news either.
            if nc.refused is None:
                await theirs(exc)

        options["error_cb"] = on_error
    try:
        await nc.connect(servers, **options)
    except LoginRefused:
        raise
    except Exception:
        if nc.refused is not None:  # allow_reconnect=False: nats-py raised it itself
            raise LoginRefused(str(nc.refused)) from None
        raise
    return nc

"""The caller's half of the stream protocol: requests out, frames back on a private inbox.

One wildcard inbox subscription per caller carries the frames of every request; each
request is a :class:`Stream` (an async iterator of chunks) that watches its replica's
heartbeats, resends what nobody accepted, moves on to another replica when its replica
fails (resuming after the text already delivered) and cancels on close. The HTTP bridge
and the public client (:class:`tokenbus.Client`, which adds ``connect`` and the
``chat``/``completions`` calls) are both :class:`Caller` s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import codec, frames, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import CLAIM
from services import bodies, natsclient, tracing
from services import logging as tlog
from services.assembly import Assembled
from services.chunks import Chunk, Completion, EmbeddingResult, Rerun, Usage
from services.frame_check import bad_field
from services.members import Members
from services.resume_point import ResumePoint
from services.stream_trace import StreamTrace

# What a stream gives, from its own modules, and the caller: what the layers above import.
__all__ = [
    "Assembled",
    "Caller",
    "Chunk",
    "Completion",
    "EmbeddingResult",
    "Rerun",
    "Sender",
    "Stream",
    "Usage",
]

DEFAULT_TIMEOUT_S = 600.0
# A stream's replica is presumed dead after this many missed heartbeats.
MISSED_BEATS = 3
WATCHDOG_INTERVAL_S = 0.25
# A stream whose replica fails (killed, stopped, its engine failed) is re-issued to another
# replica with the prompt and the text already received, at most this many times.
MAX_MIGRATIONS = 3
# How long a request waits for a broken NATS connection to come back before it is refused:
# when the server went away (refused, closed); when it stopped answering (a stall, which
# usually ends: a paused VM, a partition healing), until a second before its deadline.
RECONNECT_WAIT_S = 1.0
# "No responders" for a request (no ingress listening): sent again this many times, after
# 0.1, 0.2, 0.4, 0.8 s; nothing was done with it, so it is safe.
NO_RESPONDERS_RETRIES = 4
# A request not accepted by any replica within this long, nor said to be held by a stage
# (hold frames come every services.runtime.HOLD_NOTICE_S while one holds it), is sent again:
# the stage or router holding it may have died or stalled. The resend passes over members
# of a queue group that stopped beating (services/members.py); late accepts of the earlier
# attempt are cancelled.
ACCEPT_TIMEOUT_S = 1.5
# How long a copy this caller moved on from unread keeps running, at most, before its
# cancel, while the attempt that replaced it is not yet accepted (Client._cancel_copy).
DUPLICATE_CANCEL_WAIT_S = 2.0
MAX_RESENDS = 8
# A frame only the client's own watchdog pushes: the current attempt was never accepted.
_RETRY = "_retry"
log = tlog.get("caller")
_RETRY_FRAME = codec.encode({"t": _RETRY})
# Errors that are about the replica, not the request: another replica can continue.
MIGRATABLE = frozenset({E.ReplicaLost.code, E.ReplicaDraining.code, E.EngineError.code})
_TOMBSTONE_TTL_S = 120.0
_TOMBSTONES_MAX = 10_000


# Sends an encoded envelope with its headers and reply inbox in-process (instead of a
# publish); returns the replica that took it, or None when the accept frame will name it
# (sent on to the router). The bridge's fused stages and router are one.
Sender = Callable[[bytes, dict[str, str], str], Awaitable[str | None]]


class Stream:
    """One request's frames as an async iterator of :class:`Chunk`.

    After iteration ends, ``finish_reason``, ``usage`` and ``timings`` are set, and
    ``stop_sequence`` when a stop string ended the answer. Closing
    it (``aclose()``, leaving ``async with``, breaking out of ``async for`` in a task that is
    then cancelled) before the end cancels the request.
    """

    def __init__(
        self,
        client: Caller,
        kind: str,
        body: dict[str, Any],
        *,
        subject: str | None = None,
        sender: Sender | None = None,
        timeout: float,
        api_key: str | None,
        request_id: str | None,
        extra_headers: dict[str, str] | None,
    ) -> None:
        self._client = client
        self.kind = kind
        self.model = str(body.get("model", ""))
        self._body = body
        self._subject = subject or subjects.request(kind)
        self._sender = sender
        self.request_id = request_id or uuid.uuid4().hex
        # The id the caller gave (a label on the bus); ``request_id`` becomes the gateway's
        # own once the accept frame names it.
        self.client_request_id = self.request_id
        client._requests[self.request_id] = self
        # The inbox token is ours, never the caller's request id, so any id is safe to use.
        self.token = uuid.uuid4().hex
        self._timeout = timeout
        self._api_key = api_key
        self._extra_headers = extra_headers
        # Frames in arrival order and the one waiter: lighter than an asyncio.Queue, which
        # matters at tens of thousands of frames a second per bridge process.
        self._frames: deque[tuple[dict[str, str] | None, bytes]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[str], bool] | None = None  # see push_to
        self._held: list[bytes] = []  # frames for the sink after this loop turn's wake-ups
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False
        self._started = False
        self._done = False
        self.replica: str | None = None
        self._accepted_at = 0.0
        self._heartbeat_s = 1.0
        self._lost = False
        self._deadline = 0.0  # absolute (time.time()), fixed at the first start
        self._started_at = 0.0  # monotonic, of the current attempt
        self.migrations = 0
        extra = body.get("extra")
        echo = bool(body.get("echo") or (isinstance(extra, dict) and extra.get("echo")))
        self._delivered = ResumePoint(echo)
        self._cancelled = False
        self._no_responders = 0
        self.resends = 0  # sent again because nobody accepted it in time
        self.holds = 0  # hold frames: a stage or router said it holds the request
        self._sending = False  # an in-process sender is placing it (nothing can be lost)
        # Set once the current attempt is accepted (admitted, so its hold is written), or the
        # request ended: a copy it moved on from unread is cancelled only then (the client's
        # _cancel_copy).
        self._seated = asyncio.Event()
        self._sent_to = ""  # the subject of the current attempt (a member's own, maybe)
        # Without heartbeats: frames pushed so far, and when the watchdog last saw that grow.
        self._pushed = 0
        self._seen_pushed = 0
        self._seen_at = 0.0
        self._epoch: tuple[str, int] | None = None  # the replica's, from keepalive frames
        self.rate_limits: dict[str, str] = {}
        self._admission = ""  # the ratelimit stage's ticket for the current attempt
        self._rerun: Rerun | None = None  # see rerun_of
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        # The class that serves it (``service_tier``), from the accept frame.
        self.service_tier: str | None = None
        self.usage: Usage | None = None
        # Where usage.prompt_tokens came from when the engine did not count them ("upstream",
        # "tokenized", "estimate": an upstream without usage on its streams); None: it did.
        self.usage_source: str | None = None
        self.timings: dict[str, int] = {}
        self.t_sent_ns = 0
        self.t_first_ns = 0
        self.meta: dict[str, str | None] = {}  # what the caller wants to remember with it
        self._claim: dict[str, Any] | None = None  # its body object, deleted at its end
        # Set by a caller that routes its requests itself (the bridge's in-process router): a
        # large body stays here and is sent to the replica that asks for it, once, instead of
        # stored before routing (services/bodies.py: claim by pull).
        self.pull_bodies = False
        self._held_body: bodies.Held | None = None
        # Raises the refusal of a request too large for the model before its body is
        # uploaded (the bridge's context check), if set.
        self.before_claim: Callable[[dict[str, Any]], None] | None = None
        self._trace = StreamTrace()  # (only when tracing is on)

    def rerun_of(self, rerun: Rerun) -> None:
        """Send this request as a rerun (:class:`Rerun`); before it starts."""
        self._rerun = rerun
        self._admission = rerun.ticket

    @property
    def delivered_tokens(self) -> int:
        """Tokens of the answer received so far (every attempt's)."""
        return self._delivered.tokens

    @property
    def trace_id(self) -> str | None:
        """The W3C trace id this request carries, if any."""
        return marks.trace_id(self._extra_headers)

    # -- async iterator protocol ------------------------------------------------------------
    def __aiter__(self) -> Stream:
        return self

    async def __aenter__(self) -> Stream:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Publish the request (done by the first iteration if not called)."""
        if self._started:
            return
        await self._wait_for_connection()
        self._started = True
        now = time.time()
        if not self._deadline:
            if tracing.on():
                extra = self._trace.start(
                    self.kind, self.model, self.request_id, self._subject, self._extra_headers or {}
                )
                self._extra_headers = extra or self._extra_headers
            self._deadline = now + self._timeout
            self._timer = asyncio.get_running_loop().call_later(self._timeout, self._on_deadline)
        self._started_at = time.monotonic()
        hdrs = self._attempt_headers()
        self._client._register(self)
        self.t_sent_ns = time.time_ns()
        hdrs[H.T0] = str(self.t_sent_ns)
        reply = self._client.inbox_for(self.token)
        data = await self._encoded(hdrs)
        if self._sender is not None:
            await self._send_in_process(self._sender, data, hdrs, reply)
            return
        self._sent_to = self._client.members.subject_for(self._subject)
        try:
            await self._client.nc.publish(self._sent_to, data, reply=reply, headers=hdrs)
        except Exception as exc:
            self._finish()
            raise E.ServiceUnavailable(f"could not publish the request to NATS: {exc}") from None

    async def _wait_for_connection(self) -> None:
        """Until the NATS connection is up, within the outage wait; else the refusal."""
        nc = self._client.nc
        if not nc.is_connected and not await self._client.connected_within(
            natsclient.outage_wait(nc, RECONNECT_WAIT_S, self._stall_wait())
        ):
            # Published now, it would wait in the client's buffer for a server that is not
            # there: say so at once instead (a new request, a resend or a migration alike).
            self._done = True
            self._seated.set()
            self._client.check_refused()  # not down: closed, the login refused for good
            raise E.ServiceUnavailable(
                "the connection to NATS is down (reconnecting); retry shortly",
                headers={"Retry-After": "1"},
            )

    def _attempt_headers(self) -> dict[str, str]:
        """The headers of this attempt (a migration's or a rerun's say which, and how)."""
        hdrs = {
            H.REQUEST_ID: self.request_id,
            H.DEADLINE: str(int(self._deadline * 1000)),
        }
        attempt = self.migrations + (self._rerun.first if self._rerun else 0)
        if attempt:
            hdrs[H.MIGRATION] = str(attempt)
            if self.client_request_id != self.request_id:
                # The gateway's id from here on; the caller's stays the label of every
                # attempt's records and logs.
                hdrs[H.CLIENT_REQUEST_ID] = self.client_request_id
            if self._admission:  # proof the request was admitted: it counts once
                hdrs[H.ADMISSION] = self._admission
            if self._delivered.has_text:  # to a replica that continues the text it carries
                hdrs[H.RESUME] = "1"
        if self._api_key:
            hdrs[H.API_KEY] = self._api_key
        if not self._client.heartbeats:
            hdrs[H.KEEPALIVE] = "1"
        if self._extra_headers:
            hdrs.update(self._extra_headers)
        if self._trace.link:
            hdrs[H.TRACE_LINK] = self._trace.link
        return hdrs

    async def _encoded(self, hdrs: dict[str, str]) -> bytes:
        """The envelope as it goes on the bus (its messages by claim check when too large
        for one message); the stream ends with the refusal when it cannot go."""
        try:
            claimed = CLAIM in self._body
            big = not claimed and bodies.large_by_its_text(self._body)
            data = b"" if big else bodies.encode(self._body)
            if not claimed and (big or len(data) > bodies.THRESHOLD):
                # Too large for one message: its messages go by claim check, once (a
                # migration or resend carries the same claim).
                if self.before_claim is not None:
                    self.before_claim(self._body)
                if self.pull_bodies:
                    self._held_body = bodies.hold(self._body, self._client.owner)
                else:
                    self._claim = await bodies.put(self._client.nc, self._body, self._client.owner)
                data = bodies.encode(self._body)
        except E.TokenbusError:
            self._finish()
            raise
        # NATS refuses (and drops the connection of) a message over its max_payload.
        room = self._client.nc.max_payload - sum(len(k) + len(v) + 4 for k, v in hdrs.items())
        if len(data) > room - 1024:
            self._finish()
            raise E.PayloadTooLarge(
                f"the request is {len(data)} bytes on the bus; this bus takes at most {room - 1024}"
            )
        return data

    async def _send_in_process(
        self, sender: Sender, data: bytes, hdrs: dict[str, str], reply: str
    ) -> None:
        """Hand the request to the in-process sender (the bridge's stages and router)."""
        self._sending = True
        try:
            # An admission in this process waits on JetStream writes that ride out a
            # leaderless stream for up to 20 s: never past the request's own deadline, which
            # the frames' wait keeps too.
            left = max(0.0, self._deadline - time.time())
            # Its own task, whose outcome is read even when this request is given up on
            # while it ends (cancelled as a replica's refusal arrives): asyncio would log that
            # error as never retrieved, with a traceback, for a request nobody waits for.
            placing = asyncio.ensure_future(sender(data, hdrs, reply))
            placing.add_done_callback(_read_outcome)
            try:
                replica = await asyncio.wait_for(placing, left)
            except TimeoutError:
                self._timed_out = True
                raise E.Timeout(
                    f"no answer within the request timeout of {self._timeout:g}s"
                ) from None
            if replica:  # else the accept frame names it
                self.replica = replica
                self._accepted_at = time.monotonic()
                self._seated.set()
        except BaseException:
            # Possibly accepted by a replica after all: its accept frame gets a cancel.
            self._client._tombstone(self.token, self.request_id)
            self._finish()
            raise
        finally:
            self._sending = False
            self._started_at = time.monotonic()  # accepted from here on, or lost

    def pending(self) -> int:
        """Frames already received and not yet consumed (a consumer behind may coalesce)."""
        return len(self._frames)

    def push_to(self, sink: Callable[[str], bool] | None) -> None:
        """While set, a plain text chunk (the next in order, after the first token) that
        arrives while the consumer waits for the next chunk goes to ``sink(text)`` instead
        of waking the consumer: one callback for all such chunks of a read from NATS, not an
        event-loop turn per token. The sink runs after the turn's wake-ups (so a first
        token, which takes its consumer's turn, goes out before the plain tokens that came
        with it). ``sink`` returns False when it cannot take the text now (a client that
        reads slowly); that frame and the rest then queue for the consumer as usual, as
        does everything else (side output, the end, errors, a gap), in order."""
        self._sink = sink
        if sink is None and self._held:
            self._requeue()

    def _push(self, hdrs: dict[str, str] | None, data: bytes) -> None:
        self._pushed += 1
        # For the sink only while the consumer waits with nothing queued: whatever it took
        # is written, so the text goes out in order.
        if self._sink is not None and self._waiter is not None and not self._frames and data:
            if not self._held:
                self._client._hold(self)
            self._held.append(data)
            return
        if self._held:
            self._requeue()
        self._frames.append((hdrs, data))
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _requeue(self) -> None:
        """The held frames, in order, to the consumer (ahead of anything after them)."""
        self._frames.extend((None, d) for d in self._held)
        self._held = []
        self._wake()

    def _release(self) -> None:
        """The held frames to the sink; the first it cannot take, and the rest, queue."""
        held, sink = self._held, self._sink
        if self._done or sink is None:
            self._held = []
            return
        while held:
            if not self._take(held[0], sink):
                self._requeue()
                return
            del held[0]

    def _take(self, data: bytes, sink: Callable[[str], bool]) -> bool:
        """Whether ``data`` is the next plain text chunk and ``sink`` took its text; the
        stream then counts it as :meth:`__anext__` would have."""
        try:
            frame = frames.decode(data)
        except E.TokenbusError:
            return False
        if (
            frame.get("t") != frames.CHUNK
            or len(frame) > 4
            or not self.t_first_ns
            or bad_field(frame) is not None
        ):
            return False
        text = frame["d"]
        if int(frame.get("i", 0)) != self._delivered.next_index or not sink(text):
            return False
        self._delivered.plain(text, int(frame.get("n", 1)))
        return True

    def _on_deadline(self) -> None:
        self._timed_out = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def __anext__(self) -> Chunk:
        if not self._started:
            await self.start()
        frames_ = self._frames
        while True:
            if not frames_:
                await self._wait_for_frames()
                continue
            hdrs, data = frames_.popleft()
            if not data and hdrs and hdrs.get(H.NATS_STATUS) == "503":
                await self._on_no_responders()
                continue
            try:
                frame = frames.decode(data)
                bad = bad_field(frame)
            except E.TokenbusError:
                bad = "body"
            if bad is not None:
                # No frame of the protocol (a faulty or forged sender): this attempt cannot go
                # on, another replica may continue it.
                await self._move_on(
                    E.EngineError(f"replica {self.replica} sent a malformed frame ({bad})")
                )
                continue
            t = frame.get("t")
            if t == frames.CHUNK:
                c = await self._on_chunk(frame)
                if c is not None:
                    return c
            elif t == frames.ACCEPT:
                await self._on_accept(frame)
            elif t == frames.FINAL:
                self._on_final(frame)
                raise StopAsyncIteration
            elif t == frames.ERROR:
                await self._on_error(frame)
            elif t == frames.ALIVE:
                await self._on_alive(frame)
            elif t == _RETRY:
                await self._on_retry()
            # Unknown frame types from newer senders are skipped.

    # -- one frame each -----------------------------------------------------------------------
    async def _wait_for_frames(self) -> None:
        """Until a frame arrives; the end when the stream is done or past its deadline."""
        if self._done:
            raise StopAsyncIteration
        if self._timed_out:
            await self.aclose()
            raise E.Timeout(f"no answer within the request timeout of {self._timeout:g}s")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def _move_on(self, err: E.TokenbusError) -> None:
        """Continue on another replica after ``err`` (resuming), or end the stream with it."""
        if await self._migrate(err):
            return
        self._finish(err)
        raise err

    async def _on_no_responders(self) -> None:
        """Nobody listens (yet): nothing was done with the request, so it is safe to send
        again, a few times with backoff (an ingress reconnecting, restarting)."""
        if self._sent_to != self._subject:  # one member's own: it left
            self._client.members.forget(self._sent_to)
        if await self._resend_after_no_responders():
            return
        self._finish(E.ServiceUnavailable.code)
        raise E.ServiceUnavailable(
            "no tokenbus ingress is listening on this NATS server; start the stack "
            "(`tokenbus up`) or the ingress service"
        )

    async def _on_chunk(self, frame: dict[str, Any]) -> Chunk | None:
        """The chunk to give, None for a duplicate or after a gap (the stream moved on)."""
        if not self.t_first_ns:
            self.t_first_ns = time.time_ns()
            self._trace.first_token()
        i, expected = int(frame.get("i", 0)), self._delivered.next_index
        if i == expected:
            return self._delivered.take(frame)
        if i > expected:
            # Frames were lost on the way: continue after what did arrive.
            await self._move_on(E.ReplicaLost(f"frames of replica {self.replica} were lost"))
        return None

    async def _on_accept(self, frame: dict[str, Any]) -> None:
        other = frame.get("replica")
        if self.replica and other != self.replica and self._accepted_at:
            # A replica that was given up on (ack timeout) started anyway: stop it.
            await self._client._send_cancel(str(other), self.token, self.request_id, duplicate=True)
            return
        self.replica = other
        rid = frame.get("request_id")
        if isinstance(rid, str) and rid and not rid.endswith(".prefill"):
            # The id the gateway gave the request (ingress makes its own for every
            # admission; the client's is a label): what its records are under.
            self.request_id = rid
            self._client._requests[rid] = self
        self._delivered.resume_refused = bool(frame.get("nr"))
        if frame.get("adm"):
            self._admission = str(frame["adm"])
            if self._rerun is not None and self._rerun.on_accept is not None:
                self._rerun.on_accept(self.migrations + self._rerun.first, self._admission)
        if frame.get("tier"):
            self.service_tier = str(frame["tier"])
        if frame.get("rl"):
            self.rate_limits = {
                k: v
                for k, _, v in (p.partition("=") for p in str(frame["rl"]).split(";"))
                if k and v
            }
        self._accepted_at = time.monotonic()
        self._seated.set()
        self._heartbeat_s = float(frame.get("heartbeat_s") or 1.0)
        if self._trace.span is not None or "tp" in frame:
            self._trace.accept(other, frame.get("tp"))

    def _on_final(self, frame: dict[str, Any]) -> None:
        """The end: finish reason, usage (every attempt's tokens), timings."""
        self.finish_reason = frame.get("finish_reason")
        # Only the final frame says, so a migrated request has the last replica's.
        self.stop_sequence = frame.get("stop_sequence")
        source = frame.get("usage_source")
        self.usage_source = source if isinstance(source, str) else None
        u = frame.get("usage") or {}
        prompt = int(u.get("prompt_tokens", 0))
        # After a migration, the tokens of the earlier attempts count too.
        completion = int(u.get("completion_tokens", 0)) + self._delivered.resumed
        self.usage = Usage(
            prompt,
            completion,
            prompt + completion,
            u.get("prompt_tokens_details"),
            u.get("completion_tokens_details"),
        )
        self.timings = dict(frame.get("timings") or {})
        self._finish()

    async def _on_error(self, frame: dict[str, Any]) -> None:
        err = E.TokenbusError.from_dict(frame.get("error") or {})
        if err.code in MIGRATABLE:
            await self._move_on(err)
            return
        self._finish(err)
        raise err

    async def _on_alive(self, frame: dict[str, Any]) -> None:
        epoch = (str(frame.get("b", "")), int(frame.get("e", 0)))
        if self._epoch is not None and epoch != self._epoch and not self._lost:
            # The replica's connection broke and came back: frames may be lost.
            await self._move_on(E.ReplicaLost(f"replica {self.replica} reconnected"))
            return
        self._epoch = epoch

    async def _on_retry(self) -> None:
        """Not accepted: sent again (a stage or router holding it may be gone; the resend
        passes over queue-group members that stopped beating)."""
        if self.resends < MAX_RESENDS and await self._migrate(
            E.ServiceUnavailable("no replica accepted the request"), count=False
        ):
            self.resends += 1
            return
        self._finish(E.ServiceUnavailable.code)
        raise E.ServiceUnavailable(
            "no replica accepted the request in time (the bus or a stage is failing); retry"
        )

    def _finish(self, err: BaseException | str | None = None) -> None:
        self._seated.set()
        if not self._done:
            self._done = True
            self._client._unregister(self)
            if self._claim is not None:
                self._client.forget_body(self._claim)
                self._claim = None
            if self._held_body is not None:
                self._held_body.forget()
                self._held_body = None
            if self._trace.span is not None:
                self._trace.end(
                    err,
                    replica=self.replica,
                    migrations=self.migrations,
                    finish_reason=self.finish_reason,
                    cancelled=self._cancelled,
                    usage=self.usage,
                )
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def done(self) -> bool:
        return self._done

    def _on_pull(self, replica: str) -> None:
        """A replica asks for this request's held body: sent to it, when it is one this
        caller hears beat (a frame's word is not enough to send a body anywhere) and the
        stream still holds one."""
        held = self._held_body
        if held is None or replica not in self._client._beats:
            return
        self._client._in_background(held.send(self._client.nc, replica))

    async def _migrate(self, err: E.TokenbusError, *, count: bool = True) -> bool:
        """Re-issue the request to another replica, resuming after the text received so far
        (request migration); False when it may not (limit reached, deadline passed).
        ``count=False``: a resend of a request nobody accepted, not a migration."""
        if (
            self._cancelled
            or (count and self.migrations >= MAX_MIGRATIONS)
            or time.time() >= self._deadline - 0.05
            # Only answer text can be resumed: a tool call, reasoning or refusal half sent
            # cannot be continued elsewhere (nor an answer that echoes its prompt), nor text
            # from a replica that said its engine would start over.
            or not self._delivered.movable
        ):
            return False
        if count:
            self.migrations += 1
        old_token, old_replica = self.token, self.replica
        self._trace.moved(old_replica, err.code, self.migrations, count=count)
        self._client._unregister(self)
        if old_replica:  # if it is alive after all, it must stop
            # A resend (``count`` False: nothing of it was read) cancels a duplicate: its
            # report leaves the spend to the copy that is read (the hold is one), once that
            # copy is admitted (_cancel_copy). Not through ingress, which gives every
            # admission an id, so a hold, of its own: that copy settles its own.
            if not count and not self._subject.startswith(subjects.request_prefix()):
                self._client.cancel_copy_later(old_replica, old_token, self.request_id)
            else:
                await self._client._send_cancel(old_replica, old_token, self.request_id)
        self._client._tombstone(old_token, self.request_id, duplicate=True)
        self.token = uuid.uuid4().hex
        self.replica = None
        self._accepted_at = 0.0
        self._seated.clear()
        self._lost = False
        self._epoch = None
        # Frames of the old attempt still queued here (or held for the sink) are dropped.
        self._frames.clear()
        self._held = []
        resume = self._delivered.next_attempt()
        # In place: an in-process sender (the bridge) holds this very envelope. Embeddings
        # start over (the caller keeps them by index).
        if self.kind != subjects.KIND_EMBEDDINGS:
            self._body["resume"] = resume
        self._started = False
        self._client.log_migration(self, err)
        return await self._restart()

    async def _restart(self) -> bool:
        """Send the request again; False when it cannot go now (the stream then ends with the
        error that made it try), but a refused login ends it with the refusal."""
        try:
            await self.start()
        except E.TokenbusError as exc:
            self._client.log_migration(self, exc, failed=True)
            self._client.check_refused()
            return False
        return True

    async def _resend_after_no_responders(self) -> bool:
        if self._cancelled or self._no_responders >= NO_RESPONDERS_RETRIES:
            return False
        wait = 0.1 * 2**self._no_responders
        if time.time() + wait >= self._deadline:
            return False
        self._no_responders += 1
        await asyncio.sleep(wait)
        self._started = False
        return await self._restart()

    def _stall_wait(self) -> float:
        left = (self._deadline or time.time() + self._timeout) - time.time()
        return max(RECONNECT_WAIT_S, left - 1.0)

    def _accept_overdue(self, now: float) -> bool:
        return (
            self._started
            and not self._done
            and not self._sending
            and self._accepted_at == 0.0
            and self._started_at > 0
            and natsclient.silent_for(self._client.nc, self._started_at, now) > ACCEPT_TIMEOUT_S
        )

    async def aclose(self) -> None:
        """Stop the request; if a replica is generating for it, tell it to abort."""
        self._cancelled = True
        if not self._started or self._done:
            self._done = True
            self._seated.set()
            return
        self._finish()
        if self.replica:
            await self._client._send_cancel(self.replica, self.token, self.request_id)
        else:
            self._client._tombstone(self.token, self.request_id)

    async def assemble(self) -> Assembled:
        """Read the stream to its end and put its output together."""
        out = Assembled()
        try:
            async for c in self:
                out.add(c)
        finally:
            await self.aclose()
        return out

    async def collect(self) -> Completion:
        """Read the stream to its end and return the whole completion."""
        out = await self.assemble()
        return Completion(
            request_id=self.request_id,
            model=self.model,
            text=out.text,
            finish_reason=self.finish_reason or "stop",
            usage=self.usage or Usage(0, 0, 0),
            replica=self.replica,
            timings=self.timings,
            tool_calls=out.tool_calls,
            logprobs=out.logprobs,
            refusal=out.refusal,
            reasoning=out.reasoning,
            stop_sequence=self.stop_sequence,
            service_tier=self.service_tier,
        )

    async def collect_embeddings(self) -> EmbeddingResult:
        """Read an embeddings stream to its end: the vectors in input order."""
        out = await self.assemble()
        return EmbeddingResult(
            request_id=self.request_id,
            model=self.model,
            embeddings=out.embeddings,
            usage=self.usage or Usage(0, 0, 0),
            replica=self.replica,
        )


def _read_outcome(task: asyncio.Future[Any]) -> None:
    """Mark a finished task's error as read (its awaiter, if any, still gets it)."""
    if not task.cancelled():
        task.exception()


class Caller:
    """Sends requests on the bus and reads their frames from a private inbox."""

    def __init__(
        self,
        nc: NATS,
        *,
        owner: str | None = None,
        own_connection: bool = False,
        inbox_prefix: str | None = None,
        heartbeats: bool = True,
    ):
        self.nc = nc
        # Whether this caller follows replicas by their heartbeats; a caller that may not
        # (a key's connection) asks replicas for keepalive frames on its streams instead.
        self.heartbeats = heartbeats
        self._own = own_connection
        # ``inbox_prefix``: where this caller may subscribe (a key's inbox root on the locked
        # bus); else one of its own.
        self._prefix = inbox_prefix or subjects.inbox_prefix(owner or uuid.uuid4().hex)
        self._streams: dict[str, Stream] = {}
        # Each request's stream by its id while anything refers to it (_cancel_copy).
        self._requests: weakref.WeakValueDictionary[str, Stream] = weakref.WeakValueDictionary()
        # Set while some stream is open: the watchdog sleeps on it when there is nothing to
        # watch (an idle process wakes for nothing).
        self._watching = asyncio.Event()
        self._tombstones: OrderedDict[str, tuple[float, str, bool]] = OrderedDict()
        self._holding: list[Stream] = []  # streams with frames held for their sinks
        self._sub: Any = None
        self._hb_sub: Any = None
        self._watchdog: asyncio.Task[None] | None = None
        # replica -> (monotonic time of its last heartbeat, its heartbeat interval)
        self._beats: dict[str, tuple[float, float]] = {}
        self.on_migration: Callable[[Stream, E.TokenbusError, bool], None] | None = None
        self._epochs: dict[str, tuple[str, int]] = {}  # replica -> (boot, reconnects)
        self._background: set[asyncio.Task[None]] = set()  # cancels sent from the read loop
        self._said_done: set[asyncio.Task[None]] = set()  # bodies.done of a key's streams
        # The server refused this caller's login after it had connected (its API key revoked,
        # disabled or expired): final, the connection is closed (see :meth:`refuse`).
        self.refused: E.TokenbusError | None = None
        # Who of the ingress's (and stages') queue groups beats: a request or its resend
        # passes over one that stalled. A key's connection may follow the ingress's only.
        self.members = Members(nc, None if heartbeats else (subjects.QUEUE_INGRESS,))

    async def start(self) -> None:
        """Subscribe the inbox and the heartbeats; call once (``connect`` does it)."""
        if self._sub is None:
            # Frames go to their streams from the connection's read loop (no task between).
            self._sub = await natsclient.subscribe_direct(
                self.nc, f"{self._prefix}.*", self._on_frame
            )
            if self.heartbeats:
                self._hb_sub = await self.nc.subscribe(
                    subjects.heartbeat_wildcard(), cb=self._on_heartbeat
                )
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_replicas())
            await self.members.start()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = codec.decode_map(msg.data)
            rid = str(hb["replica"])
            self._beats[rid] = (time.monotonic(), float(hb["interval_s"]))
            epoch = (str(hb.get("boot", "")), int(hb.get("epoch", 0)))
        except (E.TokenbusError, KeyError, TypeError, ValueError, RecursionError):
            return
        if self._epochs.get(rid, epoch) != epoch:
            # The replica's connection broke and came back (or it restarted): frames of its
            # streams may be lost. Move them on, resuming after what arrived.
            for s in list(self._streams.values()):
                if s.replica == rid and s._accepted_at and not s._lost:
                    s._lost = True
                    s._push(None, frames.error(E.ReplicaLost(f"replica {rid} reconnected")))
        self._epochs[rid] = epoch

    def connection_broke(self) -> None:
        """This client's connection came back after a break: frames sent to it meanwhile
        may be lost, so every accepted stream moves on (resuming), the others are resent."""
        for s in list(self._streams.values()):
            if not s._lost:
                s._lost = True
                s._push(None, frames.error(E.ReplicaLost("the connection to NATS broke")))

    def refuse(self, err: E.TokenbusError) -> None:
        """The server refused this caller's login on a reconnect and closed the connection
        (its key was revoked, disabled or expired while connected): the open streams end
        with ``err``, and so does every request after them."""
        self.refused = err
        for s in list(self._streams.values()):
            s._push(None, frames.error(err))

    def check_refused(self) -> None:
        """Raise the refusal (:meth:`refuse`), a fresh copy, if the login was refused."""
        if self.refused is not None:
            raise E.TokenbusError.from_dict(self.refused.to_dict())

    async def _watch_replicas(self) -> None:
        """Fail streams whose replica stopped beating (killed, partitioned) instead of letting
        them wait for the request deadline: a retryable error within a few heartbeats."""
        while True:
            if not self._streams:
                self._watching.clear()
                await self._watching.wait()
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            now = time.monotonic()
            # While the server is quiet (stalled, or this connection reconnecting) nothing is
            # heard from anyone: a stall of the bus, not replicas dying. Streams wait, within
            # their deadlines; a reconnect moves them on (connection_broke).
            for s in list(self._streams.values()):
                if s._accept_overdue(now):
                    s._started_at = now + 3600  # one retry marker per attempt
                    s._push(None, _RETRY_FRAME)
                    continue
                if s.replica is None or s._accepted_at == 0.0:
                    continue
                if self.heartbeats:
                    # Not heard from it yet: count from the accept, at the announced interval.
                    last, interval = self._beats.get(s.replica, (s._accepted_at, s._heartbeat_s))
                else:
                    # Any frame of the stream (chunks, keepalives) says the replica is alive.
                    if s._pushed != s._seen_pushed:
                        s._seen_pushed, s._seen_at = s._pushed, now
                    last, interval = max(s._seen_at, s._accepted_at), s._heartbeat_s
                silent = natsclient.silent_for(self.nc, last, now)
                if silent > interval * MISSED_BEATS and not s._lost:
                    s._lost = True
                    lost = E.ReplicaLost(f"replica {s.replica} stopped answering mid-stream; retry")
                    s._push(None, frames.error(lost))
                    # Nothing of this attempt read yet: a copy whose report leaves the spend
                    # to the one that is read (a later attempt's, or its supersede's).
                    await self._send_cancel(
                        s.replica, s.token, s.request_id, duplicate=s._delivered.next_index == 0
                    )
            for rid, (last, interval) in list(self._beats.items()):
                if now - last > max(60.0, interval * MISSED_BEATS * 10):
                    del self._beats[rid]

    async def close(self) -> None:
        """Cancel open streams, unsubscribe, and close the connection if this client owns it."""
        for s in list(self._streams.values()):
            await s.aclose()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for sub in (self._sub, self._hb_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._sub = self._hb_sub = None
        if self._said_done:  # a key's finished streams' bodies said done before it goes
            await asyncio.wait(set(self._said_done), timeout=bodies.OP_TIMEOUT_S)
        if self._own and not self.nc.is_closed:  # closed already: its login was refused
            await self.nc.drain()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connected_within(self, seconds: float) -> bool:
        """Whether the NATS connection is up, or comes back within ``seconds``."""
        deadline = time.monotonic() + seconds
        while not self.nc.is_connected:
            if time.monotonic() >= deadline or self.nc.is_closed:
                return False
            await asyncio.sleep(0.05)
        return True

    async def flush(self, timeout: int = 5) -> None:
        """Until the server has read every request this caller published so far, and so has
        routed each (to a stage that takes it, or back as "no responders"). ``nc.flush()``
        does not promise that: its PING can overtake publishes nats-py has not written yet."""
        # Imported here: the service runtime stays out of what `import tokenbus` loads.
        from services.runtime import flush

        await flush(self.nc, timeout)

    @property
    def owner(self) -> str:
        """Whose request bodies this caller's are (services/bodies.py): its inbox root's."""
        owner = subjects.body_owner(self._prefix)
        assert owner is not None  # every prefix a caller is given is an inbox root
        return owner

    def forget_body(self, claim: dict[str, Any]) -> None:
        """Delete a finished stream's body object, in the background. A key's connection may
        not delete (auth/callout.py): it says the object is done, and the auth service
        deletes it (auth/bodyquota.py)."""
        if self.nc.is_closed:
            return
        loop = asyncio.get_running_loop()
        if self.heartbeats:
            task = loop.create_task(bodies.delete(self.nc, claim))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        else:
            task = loop.create_task(bodies.done(self.nc, claim))
            self._said_done.add(task)
            task.add_done_callback(self._said_done.discard)

    def inbox_for(self, token: str) -> str:
        return f"{self._prefix}.{token}"

    def log_migration(self, s: Stream, err: E.TokenbusError, *, failed: bool = False) -> None:
        """Called when a stream is re-issued for ``err``, and (``failed``) when sending it
        again failed with ``err`` (the bridge logs both); no-op here."""
        if self.on_migration is not None:
            self.on_migration(s, err, failed)

    def _register(self, s: Stream) -> None:
        self._streams[s.token] = s
        self._watching.set()

    def _unregister(self, s: Stream) -> None:
        self._streams.pop(s.token, None)

    def _tombstone(self, token: str, request_id: str, *, duplicate: bool = False) -> None:
        # A request closed before a replica accepted it: remember it so that the accept frame,
        # if it still comes, is answered with a cancel instead of a wasted generation.
        # ``duplicate``: an attempt its caller moved on from unread (a migration), whose
        # copy, if it starts, is cancelled as a duplicate (see _send_cancel).
        now = time.monotonic()
        self._tombstones[token] = (now + _TOMBSTONE_TTL_S, request_id, duplicate)
        while self._tombstones and (
            len(self._tombstones) > _TOMBSTONES_MAX
            or next(iter(self._tombstones.values()))[0] < now
        ):
            self._tombstones.popitem(last=False)

    async def _send_cancel(
        self, replica: str, token: str, request_id: str, *, duplicate: bool = False
    ) -> None:
        """Tell ``replica`` to stop the stream ``token``; ``duplicate``: a copy this caller
        never read (it was sent elsewhere meanwhile), which then leaves the request's spend
        to the copy that is read."""
        body: dict[str, Any] = {
            "type": "cancel",
            "request_id": request_id,
            "reply": self.inbox_for(token),
        }
        if duplicate:
            body["dup"] = True
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.worker_cancel(replica), codec.encode(body))

    def _hold(self, s: Stream) -> None:
        """``s`` holds frames for its sink: released two loop turns on, after the consumers
        this read from NATS woke (see :meth:`Stream.push_to`)."""
        if not self._holding:
            asyncio.get_running_loop().call_soon(self._release_next_turn)
        self._holding.append(s)

    def _release_next_turn(self) -> None:
        asyncio.get_running_loop().call_soon(self._release_held)

    def _release_held(self) -> None:
        streams, self._holding = self._holding, []
        for s in streams:
            try:
                s._release()
            except Exception:
                log.exception("stream_sink_failed", request_id=s.request_id)
                s._requeue()

    def _on_frame(self, msg: Msg) -> None:
        tok = msg.subject.rpartition(".")[2]
        if tok == subjects.INBOX_BATCH_TOKEN:
            try:
                items = frames.decode(msg.data).get("f")
            except E.TokenbusError:
                return
            for item in items if isinstance(items, list) else ():
                # ``[stream token, frame]``; anything else is no frame of ours.
                if isinstance(item, list) and len(item) == 2 and isinstance(item[1], bytes):
                    self._deliver(str(item[0]), None, item[1])
            return
        self._deliver(tok, msg.headers, msg.data)

    def _deliver(self, tok: str, hdrs: dict[str, str] | None, data: bytes) -> None:
        s = self._streams.get(tok)
        if s is not None:
            if hdrs is not None and H.BODY_PULL in hdrs:
                s._on_pull(hdrs[H.BODY_PULL])
                return
            if data == frames.HOLD_FRAME:
                # A stage or router holds this attempt (a full queue): alive, not lost.
                s.holds += 1
                if not s._accepted_at:
                    s._started_at = max(s._started_at, time.monotonic())
                return
            s._push(hdrs, data)
            return
        tomb = self._tombstones.get(tok)
        if tomb is not None and data:
            try:
                frame = frames.decode(data)
            except E.TokenbusError:
                return
            if frame.get("t") == frames.ACCEPT and frame.get("replica"):
                del self._tombstones[tok]
                if tomb[2]:
                    self.cancel_copy_later(str(frame["replica"]), tok, tomb[1])
                else:
                    self._in_background(self._send_cancel(str(frame["replica"]), tok, tomb[1]))

    def _in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def cancel_copy_later(self, replica: str, token: str, request_id: str) -> None:
        """Cancel, as a duplicate, the copy ``token`` of ``request_id`` that ``replica`` runs
        unread (this caller moved on from it), once the request's current attempt is accepted
        or the request has ended, or after :data:`DUPLICATE_CANCEL_WAIT_S` at most. A
        bridge's resend shares one hold with the copy it left (auth.budgets.SpendBook.reserve):
        the copy's report leaves that hold to the attempt that is read only when that
        attempt's admission has written it; a report that came first settled the hold as
        the copy's own, and the request then paid for both (docs/nemesis.md, finding 14)."""
        self._in_background(self._cancel_copy(replica, token, request_id))

    async def _cancel_copy(self, replica: str, token: str, request_id: str) -> None:
        s = self._requests.get(request_id)
        if s is not None and not s._seated.is_set():
            # Bounded: the copy holds a slot of its replica, which the current attempt may
            # be waiting for (a full queue); an admission takes milliseconds.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s._seated.wait(), DUPLICATE_CANCEL_WAIT_S)
        await self._send_cancel(replica, token, request_id, duplicate=True)

    def submit(
        self,
        kind: str,
        body: dict[str, Any],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        request_id: str | None = None,
        headers: dict[str, str] | None = None,
        subject: str | None = None,
        sender: Sender | None = None,
    ) -> Stream:
        """A request of ``kind`` (``chat`` or ``completions``) with an OpenAI-shaped body.

        ``subject`` sends an already-admitted envelope straight to a pipeline stage instead
        (the HTTP bridge does ingress' work itself and saves that hop).
        """
        return Stream(
            self,
            kind,
            body,
            subject=subject,
            sender=sender,
            timeout=timeout,
            api_key=api_key,
            request_id=request_id,
            extra_headers=headers,
        )

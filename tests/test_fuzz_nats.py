"""Fuzz the bus (hypothesis): malformed msgpack, envelopes and headers on every subject a role
may publish to. Every service stays alive and logs no traceback, a request that names a reply
inbox gets a decodable answer (an error frame, or the worker's ack) instead of silence, no
work is left running, and a normal request is served afterwards over HTTP and over NATS.

The subjects, by role of the locked bus (``services.natsconf.ROLES``), made concrete with
the running stack's model, replica and instance ids (found through ``$SRV.INFO``):

- client: ``tb.v1.req.{chat,completions,embeddings,<other>}``, ``tb.v1.worker.<replica>.cancel``
- ingress, auth, ratelimit, filter, bridge: ``tb.v1.stage.{auth,ratelimit,filter,route}``
- router, bridge: ``tb.v1.engine.<model>.<replica>.generate`` (and the cancel subject)
- worker: ``tb.v1.heartbeat.<model>.<replica>``, ``tb.v1.kv.<model>.<replica>``,
  ``tb.v1.replica.<id>.claim`` (for an id no worker serves),
  ``tb.v1.usage[.<limiter>]``, ``tb.v1.telemetry.>``
- bridge: ``tb.v1.audit.>``; bridge, auth, ratelimit, router: the KV buckets of routing
  changes and keys (``$KV.tokenbus_routing.*``, ``$KV.tokenbus_keys.*``)
- every role: ``_INBOX.>``: the bridge's stream inbox and its batch subject, the bounce inbox
  of every forwarding service, a NATS client's inbox and its live streams
- admin (``>``): ``tb.v1.admin.>``, ``$SRV.{PING,INFO,STATS}``

The bus is open (a nats-server of this module's own, so nothing written to its KV reaches
another test) and every subject above is published as the role would. Headers are written
on a bare protocol connection (HPUB): they may hold what nats-py would refuse or clean up
(duplicate names, invalid UTF-8, a status line, names that are not tokens, huge values).

``TOKENBUS_FUZZ_EXAMPLES`` examples per subject family (default 30: about half a minute in
``make test``); a longer run raises it (``TOKENBUS_FUZZ_EXAMPLES=500``). Inputs the fuzz once
broke a service with are kept below as plain regression tests, byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from auth.store import BUCKET as KEYS_BUCKET
from bus_schemas import codec, frames, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import SCHEMA_VERSION, ErrorFrame, WorkerAck
from filter.policy import FilterPolicy
from router.routing import BUCKET as ROUTING_BUCKET
from router.routing import RoutingTable, kv_key, set_override
from services import natsclient
from services.config import RouterSettings
from services.runtime import flush
from telemetry import records
from tests.support.busdata import key_store, new_model
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.waits import wait_for
from tokenbus import Client

pytestmark = pytest.mark.stack

FUZZ_EXAMPLES = int(os.environ.get("TOKENBUS_FUZZ_EXAMPLES", "30"))
MSG = [{"role": "user", "content": "hi"}]
# Longer than any answer of a healthy stack takes (the router waits 2 s for a worker's ack).
REPLY_TIMEOUT_S = 10.0
# How long a fire-and-forget message gets to do its harm before the logs are read: a
# negative check (nothing dies, nothing is logged meanwhile), so a fixed span.
SETTLE_S = 0.03
SERVICES = ("ingress", "auth", "ratelimit", "filter", "router", "telemetry")
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


# -- a publisher that writes any header bytes -----------------------------------------------


def header_block(pairs: list[tuple[bytes, bytes]], status: bytes = b"") -> bytes:
    """A NATS header block (``NATS/1.0[ status]``, then ``name: value`` lines) as given."""
    lines = b"".join(k + b": " + v + b"\r\n" for k, v in pairs)
    return b"NATS/1.0" + status + b"\r\n" + lines + b"\r\n"


class RawBus:
    """A bare NATS protocol connection: publishes exactly the bytes it is given."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.max_payload = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self) -> RawBus:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        info = json.loads((await self._reader.readline())[len(b"INFO ") :])
        self.max_payload = int(info["max_payload"])
        self._writer.write(
            b'CONNECT {"verbose":false,"pedantic":false,"headers":true,'
            b'"no_responders":true,"protocol":1,"name":"fuzz-raw"}\r\n'
        )
        await self.sync()
        return self

    async def publish(
        self, subject: str | bytes, payload: bytes, headers: bytes | None = None, reply: str = ""
    ) -> None:
        """Publish (cut to what the server takes), then wait until the server has read it
        (and so routed it)."""
        assert self._writer is not None
        payload = payload[: max(0, self.max_payload - len(headers or b"") - 64)]
        subj = subject.encode() if isinstance(subject, str) else subject
        subj += b" " + reply.encode() if reply else b""
        if headers is None:
            cmd = b"PUB %s %d\r\n" % (subj, len(payload))
        else:
            cmd = b"HPUB %s %d %d\r\n%s" % (
                subj,
                len(headers),
                len(headers) + len(payload),
                headers,
            )
        self._writer.write(cmd + payload + b"\r\n")
        await self.sync()

    async def sync(self) -> None:
        """A PING round trip: everything written before it has been read by the server."""
        assert self._reader is not None and self._writer is not None
        self._writer.write(b"PING\r\n")
        await self._writer.drain()
        while True:
            line = await asyncio.wait_for(self._reader.readline(), 10)
            if line.startswith(b"PONG"):
                return
            if line.startswith(b"PING"):
                self._writer.write(b"PONG\r\n")
            elif not line or line.startswith(b"-ERR"):
                raise AssertionError(f"the NATS server refused a fuzz message: {line!r}")

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()


# -- what goes wrong in a log ---------------------------------------------------------------

# A warning that a bad frame was dropped is the expected answer to the fuzz; these are not.
BAD_MARKS = (
    "Traceback",
    '"level": "error"',
    '"level": "critical"',
    # nats-py hands an exception that escaped a subscription callback to the error callback.
    '"event": "nats_error"',
    # A connection dropped by the server or by nats-py over something a message held.
    '"event": "nats_disconnected"',
    "exception was never retrieved",
)


# Errors logged on purpose for an operator, not faults: a heartbeat announcing block hashes
# a router cannot compute is refused loudly by design (docs/routing.md, "mismatch is loud
# at join"), and a forged beat may announce anything.
MEANT_ERRORS = ('"event": "kv_hashing_mismatch"',)


def bad_lines(text: str) -> list[str]:
    """Lines of a process's output that show an unhandled fault."""
    return [
        line[:600]
        for line in text.splitlines()
        if any(m in line for m in BAD_MARKS) and not any(m in line for m in MEANT_ERRORS)
    ]


class LogWatch:
    """Reads what each process wrote since the last look."""

    def __init__(self, procs: Procs) -> None:
        self.procs = procs
        self.offsets: dict[str, int] = {}

    def new_output(self) -> dict[str, str]:
        out = {}
        for p in self.procs.procs:
            data = p.log.read_bytes()
            out[p.name] = data[self.offsets.get(p.name, 0) :].decode(errors="replace")
            self.offsets[p.name] = len(data)
        return out


# -- the stack ------------------------------------------------------------------------------


@dataclass
class Target:
    """A family of subjects and the valid message the fuzz mutates for them."""

    subjects: list[str]
    base: Any
    headers: list[tuple[str, str]]
    # What a message with a reply inbox gets back: "frame" (an error frame, or the accept
    # frame of a stream the request started), "ack" (a worker's ack), "any" (some reply), or
    # None (fire and forget).
    answers: str | None = None
    json_body: bool = False


class FuzzBus:
    """The running stack and the connections the fuzz uses."""

    def __init__(
        self,
        stack: ProcStack,
        url: str,
        key: str,
        key_id: str,
        nc: NATS,
        raw: RawBus,
        client: Client,
        ids: dict[str, str],
        heartbeat: dict[str, Any],
    ) -> None:
        self.stack = stack
        self.procs = stack.procs
        self.model = stack.model
        self.replica = f"{stack.model}-0"
        self.url = url
        self.key = key
        self.key_id = key_id
        self.nc = nc
        self.raw = raw
        self.client = client
        self.ids = ids  # service name -> instance id
        self.heartbeat = heartbeat  # the replica's own, as last heard
        # The forged beats' base, frozen at start: a strategy built from a beat that changes
        # under it (load, timestamps) would draw differently when hypothesis replays.
        self.first_heartbeat = {k: v for k, v in heartbeat.items() if not k.startswith("_")}
        self.logs = LogWatch(stack.procs)
        self.client_errors: list[str] = []
        self.telemetry_db = Path()  # set by the fixture

    # -- sending --------------------------------------------------------------------------
    async def exchange(
        self,
        subject: str | bytes,
        body: bytes,
        headers: bytes | None,
        *,
        reply: bool,
        answers: str | None,
    ) -> dict[str, Any] | None:
        """Publish one message; with ``reply``, check what comes back (``Target.answers``),
        cancel a stream the message started, and return the (decoded) first answer."""
        if not reply:
            await self.raw.publish(subject, body, headers)
            return None
        inbox = self.nc.new_inbox()
        got: asyncio.Queue[Msg] = asyncio.Queue()
        sub = await self.nc.subscribe(inbox, cb=got.put)
        try:
            await flush(self.nc)  # the server has the subscription before anyone answers
            await self.raw.publish(subject, body, headers, reply=inbox)
            # A header naming another reply subject sends the stage's answer there instead.
            redirected = headers is not None and b"reply-to" in headers.lower()
            if answers is None or (answers == "frame" and redirected):
                return None
            try:
                first = await asyncio.wait_for(got.get(), REPLY_TIMEOUT_S)
            except TimeoutError:
                raise AssertionError(
                    f"no answer on {subject!r} within {REPLY_TIMEOUT_S:g} s (silence)"
                ) from None
            answer, replica = check_answer(answers, first)
            if replica:
                stream_reply = inbox
                if redirected:
                    stream_reply = seen_headers(headers).get(H.REPLY_TO, "").strip() or inbox
                await self.cancel(replica, stream_reply)
            return answer
        finally:
            await sub.unsubscribe()

    async def cancel(self, replica: str, reply: str) -> None:
        body = codec.encode({"type": "cancel", "request_id": "fuzz", "reply": reply})
        await self.nc.publish(subjects.worker_cancel(replica), body)

    # -- checks ---------------------------------------------------------------------------
    async def check_health(self, settle: float = SETTLE_S) -> None:
        """Every process alive, no fault in any log since the last look, none in the client.
        ``settle``: a negative check's span (what was sent may do harm meanwhile)."""
        await asyncio.sleep(settle)
        dead = [p.name for p in self.procs.procs if not p.alive()]
        faults = {
            name: lines
            for name, text in self.logs.new_output().items()
            if (lines := bad_lines(text))
        }
        client_errors, self.client_errors = self.client_errors, []
        assert not dead, f"processes died: {dead}"
        assert not faults, f"faults logged: {faults}"
        assert not client_errors, f"the NATS client's callbacks failed: {client_errors}"

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the replica reports no request in flight (nothing the fuzz started still
        runs)."""
        since = time.monotonic()
        deadline = since + timeout
        while time.monotonic() < deadline:
            hb = self.heartbeat
            if hb.get("_at", 0) > since and hb.get("in_flight") == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the replica still has work in flight: {self.heartbeat}")

    async def serve_over_nats(self) -> None:
        """A normal request through the NATS client is answered. Heartbeats the fuzz forged
        may leave a router's view of the replica off until the next real one: allow that."""
        last: Exception | None = None
        for _ in range(5):
            try:
                out = await self.client.chat_completion(
                    self.model, MSG, max_tokens=3, api_key=self.key, timeout=20
                )
            except E.TokenbusError as exc:
                last = exc
                await asyncio.sleep(1.0)
                continue
            assert out.usage.completion_tokens == 3
            return
        raise AssertionError(f"a normal request over NATS failed: {last!r}")

    async def serve_over_http(self) -> None:
        """A normal request through the HTTP bridge gets 200."""
        async with httpx.AsyncClient(base_url=self.stack.base, timeout=30) as h:
            r = await h.post(
                "/v1/chat/completions",
                json={"model": self.model, "messages": MSG, "max_tokens": 2},
                headers={"Authorization": f"Bearer {self.key}"},
            )
        assert r.status_code == 200, r.text

    # -- targets --------------------------------------------------------------------------
    def request_headers(self) -> list[tuple[str, str]]:
        """What a NATS client sends with a request."""
        now = time.time()
        return [
            (H.REQUEST_ID, uuid.uuid4().hex),
            (H.DEADLINE, str(int(now * 1000) + 30_000)),
            (H.T0, str(time.time_ns())),
            (H.API_KEY, self.key),
            (H.SESSION, "s-1"),
            (H.TRACEPARENT, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ]

    def stage_headers(self, stage: str) -> list[tuple[str, str]]:
        """What a stage gets from the one before it."""
        rest = {"auth": "ratelimit,filter", "ratelimit": "filter", "filter": "", "route": ""}
        hdrs = [
            (H.REQUEST_ID, uuid.uuid4().hex),
            (H.DEADLINE, str(marks.now_ms() + 30_000)),
            (H.MODEL, self.model),
            (H.KIND, "chat"),
            (H.TIMINGS, f"ingress={marks.now_ns()}"),
        ]
        if rest[stage]:
            hdrs.append((H.ROUTE, rest[stage]))
        if stage == "auth":
            hdrs.append((H.API_KEY, self.key))
        else:
            hdrs += [
                (H.PRINCIPAL, self.key_id),
                (H.LIMITS, "100000,1000000000,1000"),
                (H.FILTER_POLICY, "default"),
            ]
        return hdrs

    def engine_headers(self) -> list[tuple[str, str]]:
        """What the router sends a worker with a request."""
        owner = f"ratelimit-{self.ids['ratelimit']}"
        return [
            *self.stage_headers("route"),
            (H.ATTEMPT, "0"),
            (H.MIGRATION, "0"),
            (H.RATELIMIT, f"{int(time.time() // 60)},40,wc,{owner}"),
            (H.ADMISSION, "1,40,wc,x,0,9999999999," + "0" * 32),
        ]

    def envelope(self) -> dict[str, Any]:
        return {
            "type": "envelope",
            "v": SCHEMA_VERSION,
            "request_id": uuid.uuid4().hex,
            "kind": "chat",
            "model": self.model,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "params": {
                "max_tokens": 4,
                "max_tokens_set": True,
                "temperature": 0.5,
                "top_p": None,
                "seed": 1,
                "stop": ["zz"],
            },
            "extra": {
                "user": "u",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "tool_choice": "none",
                "response_format": {"type": "json_schema", "json_schema": {"schema": {}}},
                "logprobs": True,
                "top_logprobs": 2,
            },
            "deadline_ms": marks.now_ms() + 30_000,
            "filter_policy": FilterPolicy().to_dict(),
            "resume": {"text": "", "tokens": 0},
        }

    def inbox_frames(self) -> list[dict[str, Any]]:
        """Every frame type a caller's inbox receives."""
        return [
            {"t": "a", "replica": self.replica, "request_id": "r", "heartbeat_s": 0.2},
            {"t": "c", "d": "tok", "n": 1, "i": 0, "lp": {"content": []}},
            {
                "t": "f",
                "finish_reason": "stop",
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                "timings": {"t0": 1},
            },
            {"t": "e", "error": E.EngineError("boom").to_dict()},
            {"t": "k", "b": "boot", "e": 1},
            {"t": "b", "f": [["0" * 32, frames.chunk("x", 1, 0)]]},
        ]

    def target(self, name: str) -> Target:
        model, replica = self.model, self.replica
        hex_token = uuid.uuid4().hex
        ids = self.ids
        if name == "req":
            chat = {"model": model, "messages": MSG, "max_tokens": 2, "stream": True}
            return Target(
                [subjects.request(k) for k in subjects.KINDS] + ["tb.v1.req.nope"],
                chat,
                self.request_headers(),
                answers="frame",
            )
        if name == "req.batches":
            # Ingress' files, batches and background responses for NATS clients: an answer
            # each, ok or a typed error.
            return Target(
                [subjects.batches_state(a) for a in subjects.BATCH_ACTIONS],
                {"id": "batch_forged", "body": {"model": model, "input": "hi"}},
                self.request_headers(),
                answers="state",
            )
        if name == "to.ingress":  # one ingress by its own subject (services/members.py)
            t = self.target("req")
            t.subjects = [subjects.to_member(ids["ingress"], x) for x in t.subjects]
            return t
        if name == "to.stage":
            t = self.target("stage.auth")
            t.subjects = [subjects.to_member(ids["auth"], t.subjects[0])]
            return t
        if name == "members":  # forged beats: senders must not fail on them
            groups = [*subjects.MEMBER_GROUPS, "nope"]
            return Target([subjects.members(g) for g in groups], {"id": "forged", "every": 0.5}, [])
        if name.startswith("stage."):
            stage = name.partition(".")[2]
            return Target(
                [subjects.stage(stage)], self.envelope(), self.stage_headers(stage), "frame"
            )
        if name == "engine":
            subject = subjects.engine_generate(model, replica)
            return Target([subject], self.envelope(), self.engine_headers(), answers="ack")
        if name == "cancel":
            body = {"type": "cancel", "request_id": "r", "reply": "_INBOX.x.y"}
            subs = [subjects.worker_cancel(replica), subjects.worker_cancel("no-such-replica")]
            return Target(subs, body, [])
        if name == "heartbeat":
            # A forged beat cannot know the replica's boot id (no role but the bridge, the
            # router and telemetry hears heartbeats): the fuzz's beats carry their own.
            hb = dict(self.first_heartbeat)
            hb["boot"] = "f" * 12
            subs = [subjects.heartbeat(model, replica), subjects.heartbeat(model, "forged")]
            return Target(subs, hb, [])
        if name == "claim":
            # Claims are the worker role's own (engine_worker/claim.py): a worker trusts
            # another's, and an older one makes it stop by design. The fuzz sends them for ids
            # no worker serves (the subject, malformed payloads, to whoever listens).
            body = {"replica": "no-such-replica", "boot": "f" * 12, "since_ns": 1}
            return Target([subjects.replica_claim("no-such-replica")], body, [])
        if name == "kv.events":
            # The router follows KV events (the fuzz stack routes kv_aware): a forged batch
            # names the replica with another boot, or a replica that does not exist.
            batch = {
                "type": "kv_events",
                "replica": replica,
                "model": model,
                "boot": "f" * 12,
                "block_size": 16,
                "seq_first": 1,
                "seq_last": 2,
                "ts_ms": 1,
                "events": [
                    {"type": "stored", "hashes": [1, 2], "parent": None, "block_size": 16},
                    {"type": "removed", "hashes": [2], "medium": "gpu"},
                ],
            }
            subs = [subjects.kv_events(model, replica), subjects.kv_events(model, "forged")]
            return Target(subs, batch, [])
        if name == "telemetry":
            rec = records.build(
                request_id=uuid.uuid4().hex,
                source="worker",
                model=model,
                timings={"t0": 1, "ingress": 2, "route": 3, "engine_start": 4, "first_token": 5},
                outcome="ok",
                replica=replica,
                prompt_tokens=3,
                completion_tokens=4,
            )
            return Target([records.subject(), subjects.telemetry("other")], rec, [])
        if name == "usage":
            body = {
                "principal": self.key_id,
                "request_id": uuid.uuid4().hex,
                "window": int(time.time() // 60),
                "reserved": 40,
                "used": 7,
                "prompt": 3,
                "completion": 4,
                "flags": "wc",
                "attempt": 0,
            }
            subs = [
                subjects.usage(),
                subjects.usage(f"ratelimit-{ids['ratelimit']}"),
                subjects.usage(f"bridge-{ids['bridge']}"),
            ]
            return Target(subs, body, [])
        if name == "inbox.bridge":
            prefix = subjects.inbox_prefix(f"bridge-{ids['bridge']}")
            subs = [f"{prefix}.{hex_token}", subjects.inbox_batch(prefix)]
            return Target(subs, self.inbox_frames()[5], [(H.REQUEST_ID, "r")])
        if name == "inbox.bounce":
            subs = [
                f"{subjects.inbox_prefix(f'{svc}-{ids[svc]}')}.{hex_token}"
                for svc in ("ingress", "auth", "ratelimit", "filter", "router", "bridge")
            ]
            return Target(subs, {}, [])
        if name == "inbox.client":
            prefix = self.client._prefix
            subs = [f"{prefix}.{hex_token}", subjects.inbox_batch(prefix)]
            return Target(subs, self.inbox_frames()[5], [])
        if name == "kv.routing":
            subs = [
                f"$KV.{ROUTING_BUCKET}.{key}"
                for key in (kv_key(model), kv_key(new_model()), "x=zz", "=C3=28", "a=", "a.b")
            ]
            return Target(subs, {"policy": "round_robin"}, [], json_body=True)
        if name == "kv.keys":
            rec = {
                "id": "0123456789ab",
                "name": "forged",
                "hash": "0" * 64,
                "models": [model],
                "rpm": 5,
                "filter_policy": "strict",
            }
            subs = [f"$KV.{KEYS_BUCKET}.0123456789ab", f"$KV.{KEYS_BUCKET}.x=zz"]
            return Target(subs, rec, [], json_body=True)
        if name == "batch":
            # The batch work queue (a JetStream stream: the bridges' runners read what lands
            # here) and the background responses' events, cancels and announcements.
            line = {
                "batch": "batch_forged",
                "n": 0,
                "custom_id": "c",
                "url": "/v1/chat/completions",
                "body": {"model": model, "messages": MSG, "max_tokens": 2},
            }
            subs = [
                subjects.batch_work("batch_forged", "line"),
                subjects.batch_work("batch_forged", "validate"),
                subjects.batch_work("resp_forged", "response"),
                subjects.batch_work("batch_forged", "nope"),
                subjects.batch_events("resp_forged"),
                subjects.batch_cancel("resp_forged"),
                subjects.batch_done("forged"),
            ]
            return Target(subs, line, [])
        if name == "objects":
            # The files' object store: a forged chunk or metadata message.
            meta = {"name": "file-forged", "bucket": "tokenbus_files", "size": 3, "chunks": 1}
            subs = [
                "$O.tokenbus_files.M.ZmlsZS1mb3JnZWQ=",
                "$O.tokenbus_files.C.forged",
                "$O.other.M.x",
            ]
            return Target(subs, meta, [], json_body=True)
        if name == "bodies":
            # The claim-checked request bodies' stream: a forged chunk of an object a request
            # may name (its digest and size are checked when a service reads it).
            subs = [
                subjects.body_chunk("forged", "0" * 32, 0),
                subjects.body_chunk("tbk.someone", "f" * 32, 3),
                # A forged notice that a key's bodies were removed for its quota (a reader
                # takes its quota only when it is a whole number: else the plain 400).
                subjects.body_quota_notice("someone"),
            ]
            return Target(subs, {"x": 1}, [], json_body=False)
        if name == "admin":
            subs = [
                subjects.admin("auth", "keys"),
                subjects.admin("router", "policy"),
                subjects.audit("key.created"),
                "tb.v1.stage.nope",
            ]
            return Target(subs, {"action": "list"}, [])
        if name == "discovery":
            subs = ["$SRV.PING", "$SRV.INFO", "$SRV.STATS.tokenbus-router"]
            return Target(subs, {}, [], answers="any")
        raise KeyError(name)


def check_answer(answers: str, msg: Msg) -> tuple[dict[str, Any] | None, str | None]:
    """Check the first answer to a fuzz message: (the answer decoded, the replica that
    accepted a stream if one did)."""
    if answers == "any":
        return None, None
    if answers == "state":  # request-reply state: ok, or a typed error
        state = codec.decode_map(msg.data)
        if state.get("t") == frames.ERROR:
            assert "Traceback" not in ErrorFrame.model_validate(state).error.message, state
        else:
            assert state.get("t") == "ok", state
        return state, None
    if answers == "ack":
        ack = codec.decode_map(msg.data)
        WorkerAck.model_validate(ack)
        assert ack["ok"] or ack.get("error"), ack
        return ack, str(ack["replica"]) if ack["ok"] else None
    assert msg.data, f"an empty answer (headers {msg.headers})"
    frame = frames.decode(msg.data)
    if frame.get("t") == frames.ERROR:
        err = ErrorFrame.model_validate(frame).error
        assert "Traceback" not in err.message, err
        return frame, None
    assert frame.get("t") == frames.ACCEPT, frame
    return frame, str(frame["replica"])


def seen_headers(block: bytes | None) -> dict[str, str]:
    """The headers nats-py reads from ``block`` (the last of duplicate names wins)."""
    if not block:
        return {}
    _, _, rest = block.partition(b"\r\n")
    parsed: dict[str, str] = NATS._parse_header_lines(rest)
    return parsed


async def discover(nc: NATS, want: set[str]) -> dict[str, str]:
    """Service name -> instance id of every tokenbus service on the bus (``$SRV.INFO``), once
    each of ``want`` has answered (or 10 s have passed: the caller checks)."""
    inbox = nc.new_inbox()
    seen: dict[str, str] = {}

    async def cb(msg: Msg) -> None:
        info = json.loads(msg.data)
        seen[str(info["name"]).removeprefix("tokenbus-")] = str(info["id"])

    sub = await nc.subscribe(inbox, cb=cb)
    await nc.publish("$SRV.INFO", b"", reply=inbox)
    with contextlib.suppress(AssertionError):
        await wait_for(lambda: want <= set(seen), timeout=10)
    await sub.unsubscribe()
    return seen


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server of this module's own: what the fuzz writes to KV stays here."""
    srv = NatsServer(tmp_path_factory.mktemp("fuzz-nats")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
async def bus(
    fuzz_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FuzzBus]:
    url = fuzz_server.url
    tmp = tmp_path_factory.mktemp("fuzz-stack")
    env = {
        "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "filter", "route"]',
        "TOKENBUS_LOG_LEVEL": "warning",
        "TOKENBUS_TELEMETRY__DB_PATH": str(tmp / "telemetry.db"),
        "TOKENBUS_TELEMETRY__METRICS_PORT": "0",
        "TOKENBUS_TELEMETRY__FLUSH_INTERVAL_S": "0.1",
        # A request the fuzz starts and cannot cancel ends within seconds.
        "TOKENBUS_WORKER__SIM__MAX_MODEL_LEN": "4096",
        "TOKENBUS_INGRESS__MAX_REQUEST_S": "30",
        # Routers follow the replicas' KV events: forged ones are fuzzed too (kv.events).
        "TOKENBUS_ROUTER__POLICY": "kv_aware",
    }
    async with key_store(url, watch=False) as keys:
        key, rec = await keys.create("fuzz", rpm=100_000, tpm=10**9, max_concurrent=1000)
    with Procs(url, tmp) as procs:
        stack = await start_stack(
            procs,
            new_model(),
            *SERVICES,
            worker_args=("--sim-prefill-ms", "1", "--sim-decode-ms", "1"),
            env=env,
        )
        # The test's own connection hears the fuzz too (heartbeats): nats-py's own client
        # would stop reading on the first message it fails to parse.
        nc = await natsclient.connect(url)
        latest: dict[str, Any] = {}
        got_one = asyncio.Event()

        async def on_beat(msg: Msg) -> None:
            try:
                hb = codec.decode_map(msg.data)
            except E.TokenbusError:
                return  # one of the fuzz's
            if hb.get("boot") == latest.get("boot") or not latest:
                latest.clear()
                latest.update(hb, _at=time.monotonic())
                got_one.set()

        await nc.subscribe(subjects.heartbeat(stack.model, f"{stack.model}-0"), cb=on_beat)
        await asyncio.wait_for(got_one.wait(), 10)
        ids = await discover(nc, {*SERVICES, "bridge", "worker"})
        assert {*SERVICES, "bridge", "worker"} <= set(ids), ids
        # A policy that reads the prompt: routers and the bridge decode what they route.
        await set_override(nc, stack.model, {"policy": "prefix_aware"})
        raw = await RawBus(fuzz_server.port).connect()
        holder: list[FuzzBus] = []

        async def client_error(exc: Exception) -> None:
            if holder:
                holder[0].client_errors.append(repr(exc))

        client = await Client.connect(url, error_cb=client_error)
        fb = FuzzBus(stack, url, key, rec.id, nc, raw, client, ids, latest)
        fb.telemetry_db = tmp / "telemetry.db"
        holder.append(fb)
        # Until the services have learnt the replica: a normal request is served.
        await fb.serve_over_nats()
        fb.logs.new_output()  # start-up output is not the fuzz's doing
        try:
            yield fb
        finally:
            await client.close()
            await raw.close()
            await nc.drain()


# -- strategies -----------------------------------------------------------------------------

# Raw msgpack a Python value cannot be packed into: each replaces a marker string in a
# packed message, so any field can hold it.
RAW_MSGPACK: dict[str, bytes] = {
    "lone_surrogate": b"\xa3\xed\xa0\x80",  # a str of a UTF-16 surrogate's bytes
    "invalid_utf8": b"\xa2\xc3\x28",
    "str_longer_than_the_message": b"\xdb\xff\xff\xff\xff" + b"ab",
    "deep_list_400": b"\x91" * 400 + b"\xc0",
    "deep_list_1000": b"\x91" * 1000 + b"\xc0",
    "deep_map_5000": b"\x81\xa1k" * 5000 + b"\xc0",
    "ext": b"\xd4\x01\x00",
    "timestamp": b"\xd6\xff\x00\x00\x00\x00",
    "int_keys": b"\x81\x01\x02",
    "bin_keys": b"\x81\xc4\x01k\x01",
    "nil_key": b"\x81\xc0\x01",
    "list_key": b"\x81\x91\x01\x01",
    "duplicate_keys": b"\x82\xa1a\x01\xa1a\x02",
    "u64_max": b"\xcf" + b"\xff" * 8,
    "i64_min": b"\xd3\x80" + b"\x00" * 7,
    "reserved_byte": b"\xc1",
}
RAW_JSON: dict[str, bytes] = {
    "lone_surrogate": b'"\\ud800"',
    "invalid_utf8": b'"\xed\xa0\x80"',
    "int_beyond_64_bits": b"9" * 30,
    "int_too_long_to_parse": b"9" * 5000,
    "deep": b"[" * 3000 + b"]" * 3000,
    "nan": b"NaN",
    "duplicate_keys": b'{"a": 1, "a": [2]}',
    "unterminated": b'{"a": "',
}


def _marker(name: str) -> str:
    return f"\x00fuzz:{name}\x00"


def pack(obj: Any) -> bytes:
    """msgpack of ``obj`` with every marker replaced by its raw bytes."""
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    for name, raw in RAW_MSGPACK.items():
        data = data.replace(msgpack.packb(_marker(name), use_bin_type=True), raw)
    return data


def pack_json(obj: Any) -> bytes:
    """JSON of ``obj`` (bytes as their repr) with every marker replaced by its raw text."""
    data = json.dumps(obj, default=repr).encode()
    for name, raw in RAW_JSON.items():
        data = data.replace(json.dumps(_marker(name)).encode(), raw)
    return data


def odd_values(raw_names: list[str]) -> st.SearchStrategy[Any]:
    """Values of the wrong type, at the edges of their type, or beyond what fits."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from([2**64 - 1, -(2**63), 2**63 - 1, -1, 0, SCHEMA_VERSION + 1]),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=12),
        st.binary(max_size=12),
        st.sampled_from(["", "²", "٣", "envelope", "heartbeat", "e", "a", "c", "f", "b"]),
        st.sampled_from([1_000, 100_000, 900_000]).map(lambda n: "x" * n),
        st.sampled_from(raw_names).map(_marker),
        st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3)), max_size=3),
        st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
    )


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _apply(obj: Any, path: tuple[Any, ...], op: str, value: Any, key: Any) -> Any:
    """``obj`` with the item at ``path`` set, deleted, or given a new field."""
    if not path:
        if op == "add" and isinstance(obj, dict):
            obj[key] = value
            return obj
        return value if op != "del" else {}
    holder = obj
    for p in path[:-1]:
        holder = holder[p]
    last = path[-1]
    if op == "del":
        del holder[last]
    elif op == "add" and isinstance(holder[last], dict):
        holder[last][key] = value
    elif op == "add" and isinstance(holder[last], list):
        holder[last].append(value)
    else:
        holder[last] = value
    return obj


@st.composite
def mutated(draw: st.DrawFn, base: Any, raw_names: list[str]) -> Any:
    """``base`` with one to three fields changed, removed or added."""
    obj = copy.deepcopy(base)
    values = odd_values(raw_names)
    keys = st.one_of(st.text(max_size=6), st.sampled_from(raw_names).map(_marker))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(obj))))
        op = draw(st.sampled_from(["set", "set", "del", "add"]))
        obj = _apply(obj, path, op, draw(values), draw(keys))
    return obj


def bodies(base: Any, *, json_body: bool = False) -> st.SearchStrategy[bytes]:
    """Message bodies: valid, mutated, truncated, of the wrong type, or garbage."""
    enc, raws = (pack_json, RAW_JSON) if json_body else (pack, RAW_MSGPACK)
    valid = enc(base)
    names = sorted(raws)
    wrong_types: list[Any] = [None, 0, -1, "x", [], [1, 2], b"bin", 1.5, True, {}]
    return st.one_of(
        st.just(valid),
        mutated(base, names).map(enc),
        mutated(base, names).map(enc),
        mutated(base, names).map(enc),
        st.binary(max_size=64),
        st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n]),
        st.sampled_from(wrong_types).map(enc),
        st.sampled_from(names).map(raws.__getitem__),
    )


PROJECT_HEADERS = sorted({v for k, v in vars(H).items() if k.isupper() and isinstance(v, str)})
SPECIAL_HEADER_VALUES = [
    b"",
    b" ",
    b"-1",
    b"0",
    "²".encode(),
    "٣".encode(),
    "\uff11\uff12".encode(),  # fullwidth digits: str.isdigit() says yes
    b"1e309",
    b"nan",
    b"\xff\xfe",
    b"\xed\xa0\x80",
    b",,,",
    b"auth,auth,ratelimit",
    b"route",
    b"ingress",
    b"nope",
    b"a b",
    b">",
    b"*",
    b"a\rb\nc",
    b"_INBOX.fuzz",
    b"tb.v1.stage.auth",
    b"x=1;y",
    b"=,=,=",
    b"1,2,3,4,5,6,7",
    b"9" * 30 + b",40,wc,x",  # a Tb-Ratelimit whose window is beyond 64 bits
]
header_names = st.one_of(
    st.sampled_from(PROJECT_HEADERS).map(str.encode),
    st.sampled_from(PROJECT_HEADERS).map(lambda h: h.lower().encode()),
    st.text(
        st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"),
        min_size=1,
        max_size=12,
    ).map(str.encode),
    st.binary(min_size=1, max_size=8).filter(lambda b: not set(b) & set(b": \t\r\n")),
)
header_values = st.one_of(
    st.sampled_from(SPECIAL_HEADER_VALUES),
    st.binary(max_size=24).filter(lambda b: b"\r\n" not in b),
    st.text(max_size=24).map(str.encode),
    st.integers(-(2**70), 2**70).map(lambda i: str(i).encode()),
    st.sampled_from([4_301, 20_000, 60_000]).map(lambda n: b"9" * n),
)


odd_tokens = st.binary(min_size=1, max_size=6).filter(lambda b: not set(b) & set(b" \t\r\n.*>"))


@st.composite
def header_blocks(draw: st.DrawFn, base: list[tuple[str, str]]) -> bytes | None:
    """None, the base headers, the base headers changed, or a garbage block."""
    kind = draw(st.sampled_from(["none", "base", "changed", "changed", "changed", "garbage"]))
    if kind == "none":
        return None
    if kind == "garbage":
        return b"NATS/1.0\r\n" + draw(st.binary(max_size=80)) + b"\r\n\r\n"
    pairs = [(k.encode(), v.encode()) for k, v in base]
    if kind == "changed":
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["set", "del", "dup", "add"]))
            if op != "add" and pairs:
                i = draw(st.integers(0, len(pairs) - 1))
                if op == "set":
                    pairs[i] = (pairs[i][0], draw(header_values))
                elif op == "del":
                    del pairs[i]
                else:  # the same name again: the later one wins in nats-py
                    pairs.insert(
                        draw(st.integers(0, len(pairs))), (pairs[i][0], draw(header_values))
                    )
            else:
                pairs.append((draw(header_names), draw(header_values)))
    status = draw(st.sampled_from([b"", b"", b"", b" 503", b" 404 No Messages", b" 100 Idle"]))
    return header_block(pairs, status)


# -- the fuzz -------------------------------------------------------------------------------

FAMILIES = [
    "req",
    "req.batches",
    "stage.auth",
    "stage.ratelimit",
    "stage.filter",
    "stage.route",
    "to.ingress",
    "to.stage",
    "members",
    "engine",
    "cancel",
    "heartbeat",
    "claim",
    "kv.events",
    "telemetry",
    "usage",
    "inbox.bridge",
    "inbox.bounce",
    "inbox.client",
    "kv.routing",
    "kv.keys",
    "batch",
    "objects",
    "bodies",
    "admin",
    "discovery",
]


@pytest.mark.parametrize("family", FAMILIES)
@FUZZ_SETTINGS
@given(data=st.data())
async def test_fuzz_every_subject_a_role_may_publish_to(
    bus: FuzzBus, family: str, data: st.DataObject
) -> None:
    target = bus.target(family)
    subject: str | bytes = data.draw(st.sampled_from(target.subjects), label="subject")
    answers = target.answers
    if data.draw(st.integers(0, 5), label="odd last token") == 0:
        # Its last token not UTF-8, not printable: where a wildcard subscription (req.*,
        # inbox.*) takes it, the service must; elsewhere nobody listens.
        head = str(subject).rpartition(".")[0].encode()
        subject = head + b"." + data.draw(odd_tokens, label="token")
        answers = answers if family == "req" else None
    body = data.draw(bodies(target.base, json_body=target.json_body), label="body")
    headers = data.draw(header_blocks(target.headers), label="headers")
    reply = data.draw(st.booleans(), label="reply")
    await bus.exchange(subject, body, headers, reply=reply, answers=answers)
    await bus.check_health()


async def forge_into_live_stream(
    bus: FuzzBus, body: bytes, headers: bytes | None = None, *, batch: bool = False
) -> None:
    """Publish ``body`` into a NATS client's stream while it runs (as a frame of its own, or
    with ``batch`` as a batch message whose ``f`` holds ``[token, frame]`` items, the token
    ``"{token}"`` replaced by the stream's): the stream goes on, ends, or fails with a typed
    error, never another exception."""
    stream = bus.client.chat(bus.model, MSG, max_tokens=60, api_key=bus.key, timeout=20)
    try:
        first = await asyncio.wait_for(anext(stream), 20)
        assert first.text
        inbox = bus.client.inbox_for(stream.token)
        subject = subjects.inbox_batch(inbox.rpartition(".")[0]) if batch else inbox
        await bus.raw.publish(subject, body.replace(b"{token}", stream.token.encode()), headers)
        with contextlib.suppress(E.TokenbusError):
            async with asyncio.timeout(25):
                async for _ in stream:
                    pass
    finally:
        await stream.aclose()
    await bus.check_health()


@FUZZ_SETTINGS
@given(data=st.data())
async def test_fuzz_frames_on_a_live_stream_end_it_with_a_typed_error_at_worst(
    bus: FuzzBus, data: st.DataObject
) -> None:
    """Frames forged into a NATS client's live stream (any role may publish to an inbox;
    the bridge reads its streams with the same code)."""
    base = data.draw(st.sampled_from(bus.inbox_frames()), label="base")
    batch = base["t"] == frames.BATCH
    if batch:
        base["f"][0][0] = "{token}"
    body = data.draw(bodies(base), label="body")
    headers = data.draw(header_blocks([]), label="headers")
    await forge_into_live_stream(bus, body, headers, batch=batch)


# -- what the fuzz found, kept byte for byte -----------------------------------------------
# Each input below made a service fail before the fix its docstring names.


def _block(pairs: list[tuple[str, str]], *extra: tuple[bytes, bytes]) -> bytes:
    return header_block([(k.encode(), v.encode()) for k, v in pairs] + list(extra))


async def test_a_deadline_too_long_to_read_is_no_deadline(bus: FuzzBus) -> None:
    """Was: ingress' ``int()`` of a 4 301-digit ``Tb-Deadline`` (or of ``²``, which
    ``str.isdigit`` accepts) raised: a traceback and a 500. Header numbers are read by
    ``bus_schemas.marks.number`` now."""
    chat = pack({"model": bus.model, "messages": MSG, "max_tokens": 2})
    for deadline in (b"9" * 4301, "²".encode()):
        hdrs = header_block([(b"Tb-Api-Key", bus.key.encode()), (b"Tb-Deadline", deadline)])
        answer = await bus.exchange(
            subjects.request("chat"), chat, hdrs, reply=True, answers="frame"
        )
        assert answer is not None and answer["t"] == frames.ACCEPT, answer
    await bus.check_health()


async def test_a_header_name_that_is_no_token_is_dropped_on_the_way(bus: FuzzBus) -> None:
    """Was: auth forwarded the header ``;`` as it came and nats-py refuses to write such a
    name: the request failed with a traceback in every stage that forwards headers."""
    hdrs = _block(bus.stage_headers("auth"), (b";", b""))
    answer = await bus.exchange(
        subjects.stage("auth"), pack(bus.envelope()), hdrs, reply=True, answers="frame"
    )
    assert answer is not None and answer["t"] == frames.ACCEPT, answer
    await bus.check_health()


@pytest.mark.parametrize(
    ("stage", "field", "value"),
    [("filter", "messages", True), ("ratelimit", "params", [1]), ("filter", "kind", -489681)],
)
async def test_an_envelope_field_of_the_wrong_type_gets_an_error_frame(
    bus: FuzzBus, stage: str, field: str, value: Any
) -> None:
    """Was: the filter stage iterated ``messages: true`` (TypeError: a traceback and a 500);
    the ratelimit stage and the worker had faults of the same kind. Stages check the
    envelope (``bus_schemas.messages.check_envelope``) before they act on it."""
    hdrs = _block(bus.stage_headers(stage))
    body = pack({**bus.envelope(), field: value})
    answer = await bus.exchange(subjects.stage(stage), body, hdrs, reply=True, answers="frame")
    assert answer is not None and answer["error"]["code"] == "invalid_request", answer
    await bus.check_health()


async def test_a_usage_report_beyond_64_bits_is_not_sent(bus: FuzzBus) -> None:
    """Was: a stage that ends a request reports its usage to the limiter named in
    ``Tb-Ratelimit``; a window of 30 digits cannot be packed, and the error escaped the
    request's task (a traceback once the task was collected)."""
    hdrs = _block(bus.stage_headers("filter"), (b"Tb-Ratelimit", b"9" * 30 + b",40,wc,x"))
    body = pack({**bus.envelope(), "messages": True})
    answer = await bus.exchange(subjects.stage("filter"), body, hdrs, reply=True, answers="frame")
    assert answer is not None and answer["error"]["code"] == "invalid_request", answer
    await bus.check_health(settle=0.3)


async def test_an_output_filter_policy_of_the_wrong_shape_is_refused_in_the_ack(
    bus: FuzzBus,
) -> None:
    """Was: the worker acknowledged the request, then failed to build its output filter
    (``filter_policy.preset: null``) with a traceback."""
    env = bus.envelope()
    env["filter_policy"]["preset"] = None
    await _refused_in_the_ack(bus, env)


async def _refused_in_the_ack(bus: FuzzBus, env: dict[str, Any]) -> None:
    """``env`` sent to the replica is refused in its ack as invalid, every service alive."""
    subject = subjects.engine_generate(bus.model, bus.replica)
    ack = await bus.exchange(
        subject, pack(env), _block(bus.engine_headers()), reply=True, answers="ack"
    )
    assert ack is not None and not ack["ok"], ack
    assert ack["error"]["code"] == "invalid_request", ack
    await bus.check_health()


@pytest.mark.parametrize(
    "resume", [{"text": _marker("deep_list_1000"), "tokens": 0}, [1]], ids=["deep", "list"]
)
async def test_a_resume_of_the_wrong_shape_is_refused_in_the_ack(bus: FuzzBus, resume: Any) -> None:
    """Was (make test, 30 examples): ``resume.text`` a list nested 1 000 deep made the
    worker's ``str()`` of it raise RecursionError: a traceback and an untyped ack; a
    ``resume`` that was no map raised AttributeError."""
    await _refused_in_the_ack(bus, {**bus.envelope(), "resume": resume})


async def test_tools_of_the_wrong_type_do_not_fail_the_engine(bus: FuzzBus) -> None:
    """Was: the sim iterated ``extra.tools: 2**64 - 1`` (TypeError, a traceback in the
    worker once the request had been accepted)."""
    env = bus.envelope()
    env["extra"]["tools"] = 2**64 - 1
    subject = subjects.engine_generate(bus.model, bus.replica)
    ack = await bus.exchange(
        subject, pack(env), _block(bus.engine_headers()), reply=True, answers="ack"
    )
    assert ack is not None, ack
    await bus.check_health(settle=0.3)


async def test_a_routing_slip_naming_no_stage_gets_an_error_frame(bus: FuzzBus) -> None:
    """Was: ``Tb-Route: a b`` made the stage publish to ``tb.v1.stage.a b``: nats-py refused
    the subject and the request failed with a traceback."""
    hdrs = _block([*bus.stage_headers("ratelimit"), (H.ROUTE, "a b")])
    answer = await bus.exchange(
        subjects.stage("ratelimit"), pack(bus.envelope()), hdrs, reply=True, answers="frame"
    )
    assert answer is not None and answer["error"]["code"] == "invalid_request", answer
    await bus.check_health()


async def test_a_reply_subject_too_long_for_the_server_is_not_used(bus: FuzzBus) -> None:
    """Was: auth (or the router, or the worker) published its answer to ``Tb-Reply-To`` of
    60 000 digits; the server closed that service's connection for the overlong command line
    and nats-py never reconnected: "no auth service is running" for every NATS client."""
    long_reply = (b"Tb-Reply-To", b"9" * 60_000)
    no_key = [(k, v) for k, v in bus.stage_headers("auth") if k != H.API_KEY]
    sends = [
        (subjects.stage("auth"), pack(bus.envelope()), _block(no_key, long_reply)),
        (subjects.stage("route"), b"\x80", _block(bus.stage_headers("route"), long_reply)),
        (
            subjects.engine_generate(bus.model, bus.replica),
            pack(bus.envelope()),
            _block(bus.engine_headers(), long_reply),
        ),
    ]
    for subject, body, hdrs in sends:
        await bus.exchange(subject, body, hdrs, reply=True, answers=None)
    await bus.check_health(settle=0.3)
    await bus.serve_over_nats()


# Reply subjects outside the sender's own inbox (issue 64): a service answering there would
# write with its own rights into a key's record, the tickets' secret, a stream or another
# key's inbox.
HOSTILE_REPLIES = [
    "$KV.tokenbus_keys.fuzzvictim",
    "$KV.tokenbus_secrets.admission",
    "$JS.API.STREAM.PURGE.KV_tokenbus_keys",
    "$O.tokenbus_files.M.x",
    "tb.v1.admin.keys.create",
    "tb.v1.heartbeat.m.r",
    "_INBOX.tbk.0123456789ab.x",  # a key's inbox root, for a request of no such key
]


@FUZZ_SETTINGS
@given(
    reply=st.sampled_from(HOSTILE_REPLIES),
    where=st.sampled_from(["req", "stage.auth", "stage.route", "engine"]),
    body_kind=st.sampled_from(["bad", "chat"]),
    via_header=st.booleans(),
)
async def test_no_service_answers_outside_the_senders_inbox(
    bus: FuzzBus, reply: str, where: str, body_kind: str, via_header: bool
) -> None:
    """A message whose reply subject (or, past ingress, ``Tb-Reply-To``) is no inbox of its
    sender's gets no answer there, malformed or well formed, from ingress, a stage, the
    router or a worker; the services stay up."""
    chat = pack({"model": bus.model, "messages": [{"role": "user", "content": "hi"}]})
    if where == "req":
        subject, pairs = subjects.request("chat"), []
        body = chat if body_kind == "chat" else b"\xc1"
    elif where == "engine":
        subject, pairs = subjects.engine_generate(bus.model, bus.replica), bus.engine_headers()
        body = pack(bus.envelope()) if body_kind == "chat" else b"\xc1"
    else:
        stage = where.split(".")[1]
        subject, pairs = subjects.stage(stage), bus.stage_headers(stage)
        body = pack(bus.envelope()) if body_kind == "chat" else b"\xc1"
    pairs = [(k, v) for k, v in pairs if k != H.REPLY_TO]
    canary: list[bytes] = []

    async def heard(msg: Msg) -> None:
        canary.append(msg.data)

    watch = await bus.nc.subscribe(reply, cb=heard)
    try:
        await flush(bus.nc)
        if via_header and where != "req":
            hdrs = _block(pairs, (H.REPLY_TO.encode(), reply.encode()))
            await bus.raw.publish(subject, body, hdrs, reply=bus.nc.new_inbox())
        else:
            await bus.raw.publish(subject, body, _block(pairs) if pairs else None, reply=reply)
        # The same, answered in an inbox of ours: once that answer is back, the message
        # before it was handled (and dropped) by the same services.
        await bus.exchange(
            subject, b"\xc1", _block(pairs) if pairs else None, reply=True, answers=None
        )
        await flush(bus.nc)
        assert canary == [], (reply, where, canary[:1])
    finally:
        await watch.unsubscribe()
    await bus.check_health(settle=0.1)


async def test_a_status_line_then_bytes_not_utf8_leave_every_reader_reading(
    bus: FuzzBus,
) -> None:
    """Was: nats-py decodes a status line's description strictly, and a failure ends its read
    loop for good: this header block on the replica's heartbeat subject left the router, the
    bridge, telemetry and NATS clients running but deaf to the bus. Services connect with
    ``services.natsclient`` now."""
    status = b"NATS/1.0 503\r\ny3t|q=: RZ\x95\r\n\r\n"
    heartbeat = bus.target("heartbeat")
    await bus.raw.publish(heartbeat.subjects[0], pack(heartbeat.base), status)
    await bus.raw.publish(subjects.request("chat"), b"\x80", status)
    await bus.check_health()
    await bus.serve_over_nats()
    await bus.serve_over_http()


async def test_a_subject_that_is_not_utf8_is_answered(bus: FuzzBus) -> None:
    """Was: ``tb.v1.req.\\xff`` (any client may publish under ``tb.v1.req.>``) ended
    ingress' read loop: no NATS client was served again."""
    chat = pack({"model": bus.model, "messages": MSG, "max_tokens": 2})
    answer = await bus.exchange(b"tb.v1.req.\xff", chat, None, reply=True, answers="frame")
    assert answer is not None and answer["error"]["code"] == "not_found", answer
    await bus.check_health()
    await bus.serve_over_nats()


async def test_a_subject_with_a_form_feed_keeps_every_connection(bus: FuzzBus) -> None:
    """Was: nats-py splits the server's MSG lines on any whitespace, the server only on spaces
    and tabs: ``tb.v1.req.a\\x0cb`` misparsed at ingress, which dropped its connection and
    reconnected, losing what was in flight; on a KV subject, the watchers of auth and the
    bridge lost their place (``nats: timeout`` ever after). Patched in ``services.natsclient``."""
    chat = pack({"model": bus.model, "messages": MSG, "max_tokens": 2})
    for subject in (b"tb.v1.req.a\x0cb", b"tb.v1.req.a\x0bb"):
        answer = await bus.exchange(subject, chat, None, reply=True, answers="frame")
        assert answer is not None and answer["error"]["code"] == "not_found", answer
    heartbeat = bus.target("heartbeat")
    await bus.raw.publish(b"tb.v1.heartbeat.m.r\x0c", pack(heartbeat.base))
    await bus.raw.publish(f"$KV.{KEYS_BUCKET}.a".encode() + b"\x0cb", b"{}")
    await bus.check_health(settle=0.5)
    await bus.serve_over_nats()


async def test_a_heartbeat_whose_replica_is_a_deep_nesting_is_dropped(bus: FuzzBus) -> None:
    """Was: ``str()`` of a 1 000-deep list as the replica's name raised RecursionError out of
    the router's and the bridge's heartbeat callbacks."""
    heartbeat = bus.target("heartbeat")
    body = pack({**heartbeat.base, "replica": _marker("deep_list_1000")})
    await bus.raw.publish(heartbeat.subjects[0], body)
    await bus.check_health()


async def test_a_cancel_naming_a_deep_nesting_is_ignored(bus: FuzzBus) -> None:
    """Was: the worker took ``str()`` of a cancel's ``reply``, and a 1 000-deep list there
    raised RecursionError out of its cancel callback (a draw of the cancel fuzz, seen
    failing in CI run q). A reply that is not an inbox subject cancels nothing now."""
    cancel = bus.target("cancel")
    for reply in (_marker("deep_list_1000"), ["_INBOX.x"], "x" * 5000):
        body = pack({"type": "cancel", "request_id": "r", "reply": reply})
        await bus.raw.publish(cancel.subjects[0], body)
    await bus.check_health()


async def test_a_heartbeat_with_an_infinite_number_is_refused(bus: FuzzBus) -> None:
    """Was: the router's registry took ``int()`` of a forged beat's ``in_flight: inf``
    (msgpack carries infinite floats): OverflowError escaped the heartbeat callback, a
    traceback in the router and the bridge (a 1-in-300 draw of the heartbeat fuzz, seen
    failing in CI). A beat with such a number, or with an interval that is not a positive
    finite number, is refused as malformed now (router/registry.py)."""
    model, replica = bus.model, str(bus.first_heartbeat["replica"])
    for field, value in (("in_flight", math.inf), ("prefill_backlog", -math.inf)):
        hb = {**bus.first_heartbeat, "boot": "f" * 12, field: value}
        await bus.raw.publish(subjects.heartbeat(model, replica), pack(hb))
    hb = {**bus.first_heartbeat, "replica": "forged", "interval_s": math.inf}
    await bus.raw.publish(subjects.heartbeat(model, "forged"), pack(hb))
    await bus.check_health()


async def test_a_batch_message_of_the_wrong_shape_is_ignored(bus: FuzzBus) -> None:
    """Was: ``{0: 0, "f": [0]}`` on a caller's batch subject raised TypeError in the inbox
    callback of the bridge and of every NATS client."""
    bridge = subjects.inbox_prefix(f"bridge-{bus.ids['bridge']}")
    for prefix in (bus.client._prefix, bridge):
        await bus.raw.publish(subjects.inbox_batch(prefix), b"\x82\x00\x00\xa1f\x91\x00")
    await bus.check_health()
    await bus.serve_over_nats()


@pytest.mark.parametrize(
    "frame",
    [
        # a final frame whose usage has ``prompt_tokens: null``
        b"\x84\xa1t\xa1f\xadfinish_reason\xa4stop\xa5usage\x83\xadprompt_tokens\xc0"
        b"\xb1completion_tokens\x01\xactotal_tokens\x02\xa7timings\x81\xa2t0\x01",
        # a chunk frame without ``d``
        b"\x85\xa1t\xa1c\x00\x00\x00\x00\x00\xa3\x00\x00\x00\xa2\x00\x00\x81\xa7" + b"\x00" * 7,
        # a chunk frame whose ``n`` is null
        b"\x85\xa1t\xa1c\xa1d\xa3\x00\x00\x00\xa1n\xc0\x00\x00\xa2\x00\x00\x81\xa7" + b"\x00" * 7,
    ],
    ids=["final-usage-null", "chunk-without-text", "chunk-count-null"],
)
async def test_a_malformed_frame_in_a_live_stream_is_a_typed_error(
    bus: FuzzBus, frame: bytes
) -> None:
    """Was: KeyError or TypeError out of the stream: a traceback and a 500 in the bridge,
    an untyped exception in a NATS client. A malformed frame is an ``engine_error`` of its
    replica now (the stream moves on to another replica when it can)."""
    await forge_into_live_stream(bus, frame)


async def test_a_bad_telemetry_record_costs_only_itself(bus: FuzzBus) -> None:
    """Was: a negative count (``prompt_tokens: -2**63``) raised out of the record callback,
    and a record SQLite cannot store (``model: {}``) failed the whole batch written with it:
    the good records beside it were lost. And (make fuzz, 250 examples): a ``source``
    nested 1000 lists deep raised RecursionError out of the metrics' label handling."""
    good = uuid.uuid4().hex
    record = records.build(
        request_id=good, source="worker", model=bus.model, timings={}, outcome="ok"
    )
    deep = {"source": _marker("deep_list_1000")}
    for bad in ({"prompt_tokens": -(2**63)}, {"model": {"x": 1}}, deep):
        await bus.raw.publish(
            records.subject(), pack({**record, "request_id": uuid.uuid4().hex, **bad})
        )
    await bus.raw.publish(records.subject(), pack(record))
    await bus.check_health()

    def stored() -> bool:
        with contextlib.closing(
            sqlite3.connect(f"file:{bus.telemetry_db}?mode=ro", uri=True)
        ) as db:
            row = db.execute("SELECT COUNT(*) FROM requests WHERE request_id = ?", (good,))
            return bool(row.fetchone()[0])

    await wait_for(stored, timeout=10, what="the good record was not stored")


async def test_routing_changes_no_router_wrote_leave_the_watch_running(bus: FuzzBus) -> None:
    """Was: a key that is no escaped model name (``x=zz``) ended the routers' (and the
    bridge's) watch of routing changes for good, and a change that is JSON but no object
    (``[1]``) made every request of its model fail (AttributeError in the router)."""
    table = RoutingTable(RouterSettings())
    await table.watch(bus.nc)
    try:
        broken, later = new_model(), new_model()
        for key, value in (
            ("x=zz", b'{"policy": "round_robin"}'),
            ("=C3=28", b'{"policy": "round_robin"}'),
            (kv_key(broken), b"[1]"),
            (kv_key(broken), b"[" * 3000 + b"]" * 3000),
            (kv_key(later), b'{"policy": "round_robin"}'),
        ):
            await bus.raw.publish(f"$KV.{ROUTING_BUCKET}.{key}", value)
        await wait_for(lambda: later in table.overrides, what="the watch stopped")
        assert broken not in table.overrides
        assert table.route(broken).spec.policy == "least_outstanding"
    finally:
        await table.close()
    await bus.check_health()


# -- afterwards -----------------------------------------------------------------------------


async def test_after_the_fuzz_every_service_serves_and_stops_cleanly(bus: FuzzBus) -> None:
    await bus.check_health(settle=0.5)
    await bus.wait_idle()
    await bus.serve_over_nats()
    await bus.serve_over_http()
    await bus.check_health(settle=0.2)
    # A clean shutdown: each drains in time and exits 0, and nothing (a task that died on a
    # frame, collected only now) is reported on the way out.
    codes = {p.name: p.stop() for p in reversed(bus.procs.procs)}
    assert all(c == 0 for c in codes.values()), codes
    output = bus.logs.new_output().items()  # a service stopping disconnects: not a fault
    faults = {n: [x for x in bad_lines(t) if "nats_disconnected" not in x] for n, t in output}
    assert not any(faults.values()), faults
    for p in bus.procs.procs:
        assert "Traceback" not in p.output(), p.name
        assert bus.key not in p.output(), p.name


def test_the_families_cover_every_role() -> None:
    """Each role's publish permissions (other than the JetStream API's own subjects) are
    matched by a subject the fuzz publishes to."""
    from services.natsconf import JS_API, ROLES

    model, replica = "m", "m-0"
    examples = [
        subjects.request("chat"),
        subjects.stage("auth"),
        subjects.to_member("x", subjects.request("chat")),
        subjects.to_member("x", subjects.stage("auth")),
        subjects.members("ingress"),
        subjects.engine_generate(model, replica),
        subjects.worker_cancel(replica),
        subjects.heartbeat(model, replica),
        subjects.replica_claim(replica),
        subjects.kv_events(model, replica),
        subjects.usage(),
        subjects.usage("ratelimit-x"),
        subjects.telemetry("request"),
        subjects.audit("key.created"),
        subjects.admin("auth", "keys"),
        "_INBOX.tb.bridge-x.y",
        f"$KV.{ROUTING_BUCKET}.m",
        "$SRV.PING",
        subjects.batch_work("b", "line"),
        "$O.tokenbus_files.C.x",
        subjects.body_chunk("forged", "0" * 32, 0),
        subjects.body_quota_notice("someone"),
    ]
    for role, (pub, _) in ROLES.items():
        for pattern in pub:
            if pattern.startswith("$JS.") or (pattern in JS_API and not pattern.startswith("$KV")):
                continue  # the JetStream API itself: the server's, not a service's
            assert any(_matches(pattern, s) for s in examples), (role, pattern)


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)

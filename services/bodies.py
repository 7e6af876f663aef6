"""Claim checks: request bodies larger than one bus message (docs/large-requests.md).

A request whose encoded envelope is over :data:`THRESHOLD` keeps its large parts
(``messages``, ``prompt``, ``input``: :data:`bus_schemas.messages.CLAIMED`) as chunks in the
JetStream stream :data:`bus_schemas.subjects.BODIES_STREAM`, and the envelope on the bus
carries a ``claim`` instead: owner, object id, size, sha256, chunk count. The caller
(:class:`services.caller.Stream`: the bridge, :class:`tokenbus.Client`) uploads it with
:func:`put` and deletes it when its stream ends (:func:`delete`); the stream's age limit
removes what a crash leaves. Every consumer that reads the text resolves it once with
:func:`resolve`; every producer of envelope bytes uses :func:`encode`, which leaves the
claimed parts out again. A small request never carries a claim: its bytes do not change.

Why a stream of our own rather than nats' object store (``$O.<bucket>.C.<nuid>``): chunk
subjects that name their owner let a key's connection be allowed to write its own bodies
and nothing else, and a reader needs only a direct get by subject
(``$JS.API.DIRECT.GET.<stream>.<chunk>``), no consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import secrets
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, cast

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas.messages import CLAIM, CLAIMED, envelope_chars
from services import buckets, natsclient
from services.config import kv_replicas

# An envelope over this many bytes goes by claim check. nats-server's max_payload is 1 MiB
# and a message's headers (request id, marks, trace context, ~1-2 KiB) share it; what the
# stages add after the caller measured (filter policy, kv_transfer_params, a migration's
# resume text: the answer so far, which can reach hundreds of KiB) must still fit. Half the
# payload leaves that room; below it nothing changes for a request.
THRESHOLD = 512 * 1024
# One JetStream message per chunk, well under max_payload with its headers.
CHUNK = 256 * 1024
# A body sent on request (a claim by pull) goes in smaller messages: nats-server forwards a
# message only once it has all of it, so smaller ones overlap the sender's write, the
# server's forward and the replica's read (4 MiB, one nats-py connection to another: about
# 7 ms in 64 KiB messages, 10-12 ms in 256 KiB ones; docs/large-requests.md).
PULL_CHUNK = 64 * 1024
# The largest body object anyone may declare or write: the bridge's body bound (32 MiB,
# services/config.py) plus the envelope around it. A claim naming more is hostile.
MAX_OBJECT = 40 * 1024 * 1024
# An object nobody deleted (its caller crashed) is gone after this: longer than the longest
# request (ingress.max_request_s, 600 s) so that a migration late in a stream still finds it.
TTL_S = 900.0
# The stream's bound; when full, a new body is refused (503) rather than an old one dropped.
MAX_BYTES = 4 * 1024 * 1024 * 1024
# How long a read or write of one chunk may take before the store counts as stalled (503).
OP_TIMEOUT_S = 5.0
# Chunks a process reads at once, all its requests together: 4 MiB in flight. Unbounded, eight
# 16 MB bodies fetched at once put 128 MB of answers on one connection, past nats-server's
# pending limit for a client (64 MB): the server cut the worker off as a slow consumer
# (measured: tokenbus bench --prompt-bytes 16777216 --concurrency 8).
READ_WINDOW = 16
_windows: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
RETRY_AFTER_S = "2"
# nats-server's JetStream API (a purge's answer says how many messages it removed; nats-py's
# purge_stream says only whether it succeeded).
JS_API = "$JS.API"

# How often one held body is sent on request (a claim by pull): the first replica, one per
# migration or resend, a prefill and its decode. Past it a pull is ignored (a forged or
# runaway sender), and the replica that asked gets no body (503 after OP_TIMEOUT_S).
MAX_PULLS = 16

_OWNER = re.compile(r"^tbk?\.[A-Za-z0-9_~\-]{1,128}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def config() -> api.StreamConfig:
    """The bodies stream: file storage, age- and size-bounded, new writes refused when full."""
    return api.StreamConfig(
        name=subjects.BODIES_STREAM,
        description="tokenbus: request bodies too large for one message (claim checks)",
        subjects=[subjects.bodies_wildcard()],
        max_age=TTL_S,
        max_bytes=MAX_BYTES,
        max_msg_size=CHUNK + 4096,
        discard=api.DiscardPolicy.NEW,
        # Read by direct get: the chunk's bytes as they are (no base64 in JSON), on an API
        # subject that names the chunk (so permissions can scope it).
        allow_direct=True,
        storage=api.StorageType.FILE,
        num_replicas=kv_replicas(),
    )


async def open_stream(nc: NATS) -> None:
    """Make the bodies stream if it is missing (the bridge and ingress do, at start)."""
    await buckets.open_stream(nc.jetstream(), config())


def encode(env: dict[str, Any]) -> bytes:
    """``env`` as bytes for the bus: without its claimed parts when it carries a claim."""
    if CLAIM in env:
        return codec.encode({k: v for k, v in env.items() if k not in CLAIMED})
    return codec.encode(env)


def large_by_its_text(env: dict[str, Any]) -> bool:
    """Whether ``env``'s text alone is over :data:`THRESHOLD`, so that it goes by claim check
    without encoding it whole to measure it (each character is at least one byte encoded; a
    token id prompt is left to the measure: its text form is longer than its encoding)."""
    return not isinstance(env.get("prompt"), list) and envelope_chars(env) > THRESHOLD


def _unavailable(what: str) -> E.ServiceUnavailable:
    return E.ServiceUnavailable(
        f"the store of large request bodies {what}; retry shortly",
        headers={"Retry-After": RETRY_AFTER_S},
    )


async def put(nc: NATS, env: dict[str, Any], owner: str) -> dict[str, Any]:
    """Upload ``env``'s claimed parts under ``owner`` and set ``env['claim']``; the claim.

    503 (Retry-After) when the store is missing, stalled or full; 413 past :data:`MAX_OBJECT`.
    """
    blob, chars = _encoded_parts(env)
    oid = secrets.token_hex(16)  # unguessable: nobody can name another caller's body
    chunks = [blob[i : i + CHUNK] for i in range(0, len(blob), CHUNK)] or [b""]
    js = nc.jetstream()
    # The digest in a thread while the chunks travel: sha256 releases the GIL, and 4 MiB of it
    # on the event loop held every other request of this process for about 2.5 ms.
    try:
        sha256, *_ = await asyncio.gather(
            asyncio.to_thread(_sha256, blob),
            *(
                js.publish(subjects.body_chunk(owner, oid, n), c, timeout=OP_TIMEOUT_S)
                for n, c in enumerate(chunks)
            ),
        )
    except Exception as exc:
        await delete(nc, {"owner": owner, "id": oid})
        raise _unavailable(f"did not take the body ({type(exc).__name__})") from None
    claim = {
        "owner": owner,
        "id": oid,
        "size": len(blob),
        "sha256": sha256,
        "chunks": len(chunks),
        "chars": chars,
    }
    env[CLAIM] = claim
    return claim


def _encoded_parts(env: dict[str, Any], view: bool = False) -> tuple[bytes, int]:
    """``env``'s claimed parts encoded as one body object, and their text's characters;
    413 past :data:`MAX_OBJECT`. ``view``: the encoding as a view of the encoder's buffer
    (:func:`bus_schemas.codec.encode_view`), for a body this process holds."""
    parts = {k: env[k] for k in CLAIMED if k in env}
    blob = cast(bytes, codec.encode_view(parts)) if view else codec.encode(parts)
    if len(blob) > MAX_OBJECT:
        raise E.PayloadTooLarge(
            f"the request's messages are {len(blob)} bytes; tokenbus takes at most {MAX_OBJECT}"
        )
    return blob, envelope_chars(parts)


def check_claim(claim: Any, *, pull_ok: bool = False) -> dict[str, Any]:
    """``claim`` if it is well formed (hostile input: any field may lie); 400 if not.
    ``pull_ok``: a claim by pull is taken (only a worker, which asks its caller for it)."""
    if not isinstance(claim, dict):
        raise E.InvalidRequest("claim: not an object")
    owner, oid, size = claim.get("owner"), claim.get("id"), claim.get("size")
    digest, chunks = claim.get("sha256"), claim.get("chunks")
    if not (isinstance(owner, str) and _OWNER.match(owner)):
        raise E.InvalidRequest("claim.owner: not a body owner")
    if not (isinstance(oid, str) and _HEX32.match(oid)):
        raise E.InvalidRequest("claim.id: not an object id")
    if not (isinstance(size, int) and not isinstance(size, bool) and 0 < size <= MAX_OBJECT):
        raise E.InvalidRequest(f"claim.size: not a size from 1 to {MAX_OBJECT}")
    pull = claim.get("pull")
    if pull is not None:
        if pull is not True:
            raise E.InvalidRequest("claim.pull: true or absent")
        if not pull_ok:
            raise E.InvalidRequest(
                "claim.pull: a body sent on request is read only by the replica it is sent to; "
                "send a large request's messages by claim check (services/bodies.py put)"
            )
        if digest is not None:
            raise E.InvalidRequest("claim.sha256: a body sent on request carries no digest")
    elif not (isinstance(digest, str) and _HEX64.match(digest)):
        raise E.InvalidRequest("claim.sha256: not a sha256 digest")
    if chunks != -(-size // (CHUNK if pull is None else PULL_CHUNK)):
        raise E.InvalidRequest("claim.chunks: does not match its size")
    return claim


async def fetch(nc: NATS, claim: dict[str, Any]) -> dict[str, Any]:
    """The claimed parts ``claim`` names, checked against its size and digest.

    400 when the object is missing, truncated, tampered with or not an envelope's parts;
    503 (Retry-After) when the store does not answer in time.
    """
    claim = check_claim(claim)
    js = nc.jetstream()

    window = _window()

    async def chunk(n: int) -> bytes:
        subject = subjects.body_chunk(claim["owner"], claim["id"], n)
        async with window:
            msg = await asyncio.wait_for(
                js.get_msg(subjects.BODIES_STREAM, subject=subject, direct=True), OP_TIMEOUT_S
            )
        return msg.data or b""

    try:
        got = await asyncio.gather(*(chunk(n) for n in range(claim["chunks"])))
    except NotFoundError:
        raise await _missing(nc, claim["owner"]) from None
    except Exception as exc:
        raise _unavailable(f"did not answer ({type(exc).__name__})") from None
    # Off the event loop: joining, hashing and decoding 16 MB take tens of ms of CPU (more on
    # a loaded machine), and eight such bodies at once held a worker's loop past its
    # heartbeats (docs/large-requests.md). sha256 releases the GIL; the join and the decode
    # are one C call each, so the loop waits at most for one of them, not for all.
    return await asyncio.to_thread(_unpack, got, claim)


def _sha256(blob: bytes | bytearray) -> str:
    return hashlib.sha256(blob).hexdigest()


def _unpack(got: list[bytes] | list[bytearray], claim: dict[str, Any]) -> dict[str, Any]:
    """The claimed parts from the chunks ``got``, checked against ``claim``'s size and
    digest (a claim by pull: its size; each chunk's was checked as it came), 400 when they
    do not match or are not an envelope's parts."""
    blob = got[0] if len(got) == 1 else b"".join(got)
    if len(blob) != claim["size"] or ("pull" not in claim and _sha256(blob) != claim["sha256"]):
        raise E.InvalidRequest(
            "the request's body object does not match its size and sha256 digest (truncated "
            "or altered); send the request again"
        )
    try:
        parts = codec.decode_map(blob)
    except E.TokenbusError:
        raise E.InvalidRequest("the request's body object is not an encoded body") from None
    if not set(parts) <= set(CLAIMED):
        raise E.InvalidRequest("the request's body object holds fields a body does not")
    return parts


async def _missing(nc: NATS, owner: str) -> E.TokenbusError:
    """Why an object of ``owner`` is missing: 429 naming the quota when the auth service
    removed the key's bodies for it lately (its notice, auth/bodyquota.py), else 400."""
    notice = await quota_notice(nc, owner)
    if notice is not None:
        quota, scope = notice
        whose = (
            "the large request bodies of this API key's owner (all its keys)"
            if scope == "owner"
            else "this API key's large request bodies"
        )
        setting = (
            "bodies.max_bytes_per_owner"
            if scope == "owner"
            else "bodies.max_bytes_per_key, or the key's max_body_bytes"
        )
        return E.RateLimited(
            f"the request's body object was removed: {whose} held more than the quota of "
            f"{quota} bytes in the store at once ({setting}), so this key's were removed; "
            f"send the request again with fewer large requests in flight",
            headers={"Retry-After": RETRY_AFTER_S},
        )
    return E.InvalidRequest(
        "the request's body object is missing or incomplete (expired, deleted, or never "
        "wholly written); send the request again"
    )


async def quota_notice(nc: NATS, owner: str) -> tuple[int, str] | None:
    """The quota in the auth service's last notice that it removed ``owner``'s bodies (within
    the stream's age limit) and whose it was (``key``, or ``owner``: all the keys of the
    key's owner), or None: none, not a key's owner, or the store did not say."""
    kind, _, key_id = owner.partition(".")
    if kind != "tbk" or not key_id:
        return None
    js = nc.jetstream()
    try:
        msg = await asyncio.wait_for(
            js.get_msg(
                subjects.BODIES_STREAM, subject=subjects.body_quota_notice(key_id), direct=True
            ),
            OP_TIMEOUT_S,
        )
        notice = json.loads(msg.data or b"{}")
        quota, scope = notice.get("quota"), notice.get("scope")
    except Exception:  # no notice (NotFoundError), or a store too slow to say: the plain 400
        return None
    if not isinstance(quota, int) or isinstance(quota, bool):
        return None
    return quota, "owner" if scope == "owner" else "key"


async def purge(nc: NATS, subject: str, below: int | None = None) -> int:
    """Remove the messages on ``subject`` (a filter; with ``below``, those of stream sequence
    under it only) from the bodies stream; how many it removed (0: none left to remove)."""
    req: dict[str, Any] = {"filter": subject}
    if below is not None:
        req["seq"] = below
    resp = await nc.request(
        f"{JS_API}.STREAM.PURGE.{subjects.BODIES_STREAM}",
        json.dumps(req).encode(),
        timeout=OP_TIMEOUT_S,
    )
    answer = json.loads(resp.data)
    if not answer.get("success"):
        raise RuntimeError(f"purge refused: {answer.get('error')}")
    return int(answer.get("purged", 0))


async def done(nc: NATS, claim: dict[str, Any]) -> None:
    """Say that the object ``claim`` names is no longer needed, for a caller that may not
    delete it (a key's connection): the auth service removes it (auth/bodyquota.py). An
    empty message under the caller's own owner, which only it may write."""
    with contextlib.suppress(Exception):  # best effort: the age limit removes it otherwise
        await nc.publish(subjects.body_done(claim["owner"], claim["id"]), b"")


def _window() -> asyncio.Semaphore:
    """This event loop's bound on chunks read at once (:data:`READ_WINDOW`)."""
    loop = asyncio.get_running_loop()
    window = _windows.get(loop)
    if window is None:
        window = _windows[loop] = asyncio.Semaphore(READ_WINDOW)
    return window


async def resolve(
    nc: NATS, env: dict[str, Any], puller: tuple[str, Callable[[], Awaitable[None]]] | None = None
) -> dict[str, Any]:
    """``env`` with its claimed parts in place (fetched once: an envelope that holds them
    already, or carries no claim, is returned as it is). Changes ``env`` in place.
    ``puller``: (this replica's id, how to ask the caller for the body) for a claim by pull;
    without it such a claim is a 400."""
    claim = env.get(CLAIM)
    if claim is None or any(k in env for k in CLAIMED):
        return env
    if puller is not None and isinstance(claim, dict) and claim.get("pull") is not None:
        env.update(await pull(nc, claim, *puller))
    else:
        env.update(await fetch(nc, claim))
    return env


# -- claim by pull ----------------------------------------------------------------------------
# A caller that routes its requests itself (the bridge with its router in-process) need not
# store a large body before it knows who serves it: the body stays in the caller's memory,
# the envelope carries a claim with ``pull: true``, and the replica chosen asks for it with an
# empty frame to the caller's inbox (header Tb-Body-Pull: its id). The caller then sends the
# chunks once, to ``engine_body(replica, id)`` (under that replica's own engine subjects).
# One pass over the bus instead of two (an upload, then a read) and no store write: measured
# in docs/large-requests.md. A migration's next replica asks again.
#
# No digest: the replica checks each chunk's size and the whole's, and that the whole decodes
# as a body's parts. A digest would guard against a sender that can publish under the
# replica's engine subjects, which can send it any request anyway (only the roles that
# dispatch to workers may: services/natsconf.py), and hashing cost both sides a pass over the
# body on the request's path (sha256 of 4 MiB: 2.3 ms on each). A stored object keeps its
# digest: it stays in a store for minutes under a name its owner's key can write.

# This process's held bodies by object id, while their streams are open.
_held: weakref.WeakValueDictionary[str, Held] = weakref.WeakValueDictionary()


class Held:
    """A body kept by its caller for a claim by pull, and its sends."""

    def __init__(self, claim: dict[str, Any], enc: _Encoded) -> None:
        self.claim, self._enc, self.blob = claim, enc, enc.blob
        self.sent = 0
        _held[claim["id"]] = self

    async def send(self, nc: NATS, replica: str) -> None:
        """The body's chunks to ``replica`` (nothing past :data:`MAX_PULLS`)."""
        if self.sent >= MAX_PULLS:
            return
        self.sent += 1
        prefix = subjects.engine_body(replica, self.claim["id"])
        view = memoryview(self.blob)
        # Views of the held body, not copies, to the socket at once in one write: the server
        # forwards the first chunk while the rest are still being written.
        chunks = [
            (f"{prefix}.{n}", cast(bytes, view[n * PULL_CHUNK : (n + 1) * PULL_CHUNK]))
            for n in range(self.claim["chunks"])
        ]
        with contextlib.suppress(Exception):  # a connection down: the replica's wait ends it
            await natsclient.publish_all_at_once(nc, chunks)

    def forget(self) -> None:
        _held.pop(self.claim["id"], None)


def held(object_id: str) -> Held | None:
    """This process's held body ``object_id``, if its stream is open."""
    return _held.get(object_id)


class _Encoded:
    """Claimed parts encoded once for every held body that carries the very same ones (a
    request's ``n`` choices are ``n`` requests on the bus sharing one ``messages`` list):
    one encoding and one copy in memory, not ``n``. Kept while a held body refers to it
    (a weak map); its values are held too, so that their identities, the key, stay theirs."""

    __slots__ = ("__weakref__", "blob", "chars", "values")

    def __init__(self, values: tuple[Any, ...], env: dict[str, Any]) -> None:
        self.values = values
        self.blob, self.chars = _encoded_parts(env, view=True)


_encodings: weakref.WeakValueDictionary[tuple[int, ...], _Encoded] = weakref.WeakValueDictionary()


def hold(env: dict[str, Any], owner: str) -> Held:
    """Keep ``env``'s claimed parts here and set ``env['claim']`` (a claim by pull) to name
    them; 413 past :data:`MAX_OBJECT`. Each call its own claim (its own id, its own pulls);
    the encoding is shared with the held bodies of the same parts (:class:`_Encoded`)."""
    values = tuple(env[k] for k in CLAIMED if k in env)
    key = tuple(id(v) for v in values)
    # A live entry holds its values, so no other object has their ids: the same parts.
    enc = _encodings.get(key)
    if enc is None:
        enc = _encodings[key] = _Encoded(values, env)
    claim = {
        "owner": owner,
        "id": secrets.token_hex(16),
        "size": len(enc.blob),
        "chunks": -(-len(enc.blob) // PULL_CHUNK),
        "chars": enc.chars,
        "pull": True,
    }
    env[CLAIM] = claim
    return Held(claim, enc)


async def pull(
    nc: NATS,
    claim: dict[str, Any],
    replica: str,
    ask: Callable[[], Awaitable[None]],
    timeout: float = OP_TIMEOUT_S,
) -> dict[str, Any]:
    """The parts of a claim by pull, asked of the caller with ``ask`` by ``replica`` and
    checked against the claim's size, chunk by chunk: 400 when they do not match or do not
    decode, 503 (Retry-After) when they stop coming for ``timeout`` (a caller gone, or that
    never sends)."""
    claim = check_claim(claim, pull_ok=True)
    size = claim["size"]
    # Each chunk is copied into place as it comes, while the rest are on their way: no join
    # of the whole after the last one (0.7 ms at 4 MiB, on the request's path).
    blob = bytearray(size)
    got = [False] * claim["chunks"]
    complete, wrong = asyncio.Event(), []
    have = 0

    def on_chunk(msg: Msg) -> None:
        nonlocal have
        try:
            n = int(msg.subject.rpartition(".")[2])
        except ValueError:
            return
        if 0 <= n < len(got) and not got[n]:
            data = msg.data or b""
            at = n * PULL_CHUNK
            if len(data) != min(PULL_CHUNK, size - at):
                wrong.append(n)
                complete.set()
                return
            blob[at : at + len(data)] = data
            got[n] = True
            have += 1
            if have == len(got):
                complete.set()

    box = await _inbox(nc, replica, timeout)
    oid = claim["id"]
    box.pulls.setdefault(oid, []).append(on_chunk)
    try:
        await ask()
        seen = -1
        while not complete.is_set():
            if have == seen:  # nothing came for a whole timeout
                raise E.ServiceUnavailable(
                    f"the request's body did not come from its caller ({have} of {len(got)} "
                    "chunks); retry shortly",
                    headers={"Retry-After": RETRY_AFTER_S},
                )
            seen = have
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(complete.wait(), timeout)
    finally:
        box.drop(oid, on_chunk)
    if wrong:
        raise E.InvalidRequest(
            f"the request's body came with chunk {wrong[0]} of the wrong size (truncated or "
            "altered); send the request again"
        )
    # On the loop: one C call of about 1 ms at 16 MiB (a thread's hand-over cost more than
    # it saved at 4 MiB).
    return _unpack([blob], claim)


class _BodyInbox:
    """A replica's standing subscription to the bodies sent to it, subscribed (and the
    server sure of it) once: each chunk goes to the pull waiting for its object, any other
    is dropped. A pull so asks its caller at once, without a round trip to the server
    first (a subscription of its own per body needs one: the caller must not send before
    the server knows where to)."""

    def __init__(self) -> None:
        # Object id -> the pulls waiting for it (one, but for a resend of the same request).
        self.pulls: dict[str, list[Callable[[Msg], None]]] = {}
        self.ready: asyncio.Future[None] | None = None

    def on_msg(self, msg: Msg) -> None:
        head = msg.subject.rpartition(".")[0]  # <engine_body(replica, id)>.<n>
        for fn in self.pulls.get(head.rpartition(".")[2], ()):
            fn(msg)

    def drop(self, oid: str, fn: Callable[[Msg], None]) -> None:
        """``fn`` no longer waits for object ``oid``."""
        fns = self.pulls.get(oid, [])
        if fn in fns:
            fns.remove(fn)
        if not fns:
            self.pulls.pop(oid, None)


# Per connection, per replica id it pulls for.
_inboxes: weakref.WeakKeyDictionary[NATS, dict[str, _BodyInbox]] = weakref.WeakKeyDictionary()


async def _inbox(nc: NATS, replica: str, timeout: float) -> _BodyInbox:
    """``replica``'s standing subscription on ``nc`` (made at its first pull)."""
    boxes = _inboxes.setdefault(nc, {})
    box = boxes.get(replica)
    if box is None:
        box = boxes[replica] = _BodyInbox()

        async def subscribe() -> None:
            subject = f"{subjects.engine_body(replica, '*')}.*"
            await natsclient.subscribe_direct(nc, subject, box.on_msg)
            await nc.flush(int(timeout) or 1)  # subscribed before any caller is asked

        box.ready = asyncio.ensure_future(subscribe())
    assert box.ready is not None
    try:
        await asyncio.shield(box.ready)
    except Exception:
        if boxes.get(replica) is box:  # the next pull subscribes again
            del boxes[replica]
        raise
    return box


async def delete(nc: NATS, claim: dict[str, Any]) -> None:
    """Remove the object ``claim`` names (best effort: its age limit removes it otherwise)."""
    try:
        await asyncio.wait_for(
            nc.jetstream().purge_stream(
                subjects.BODIES_STREAM, subject=subjects.body_object(claim["owner"], claim["id"])
            ),
            OP_TIMEOUT_S,
        )
    except Exception:  # expiry cleans up what a failed purge leaves
        return

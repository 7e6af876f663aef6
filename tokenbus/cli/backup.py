"""``tokenbus backup --out DIR`` and ``tokenbus restore --from DIR``: every store tokenbus
keeps in JetStream, copied while the stack serves and put back on an empty bus.

What is copied is :data:`STORES`: the KV buckets, the object store and the streams (their
JetStream streams: ``KV_<bucket>``, ``OBJ_<bucket>``, or the stream's own name). The only
store left out is :data:`SKIPPED` (the rate limiters' windows, in memory, rebuilt within a
minute). A test fails when a bucket or stream name appears in the code but in neither.

**Online and cluster-aware.** Everything goes through the JetStream API (stream info, and a
``STREAM.MSG.GET`` of the next message after a sequence, which the stream's leader answers),
so any node of a cluster serves it and no store folder is read. Each stream's last sequence
is taken before any is read: everything acknowledged before the backup began is in it. A KV
entry changed while the copy runs is kept in its newer value (the copy reads on to the
stream's end as it was when the copy reached that first last sequence), never lost.

**Format** (portable, no pickle): ``DIR/manifest.json`` (the format, its version, when, and
per stream its kind, message count and the SHA-256 of its messages file), and per stream
``DIR/<stream>/config.json`` (the stream's configuration as JetStream reports it) and
``DIR/<stream>/messages.jsonl``, one message a line: ``{"seq", "subject", "headers",
"data"}`` with the data in base64. A backup is written to ``DIR.partial`` and renamed to
``DIR`` once whole: a ``DIR`` that exists is complete.

**Restore** checks the whole backup (manifest, files, checksums) before it touches the bus,
then refuses when any of its streams exists on the bus with messages in it (``--force``
deletes such a stream first). Each stream is made with its saved configuration (replicas:
``--replicas``, else ``kv_replicas()``) or, where the stream exists empty (a service made
it), kept; then its messages are published again in order with their subjects, headers and
data: KV entries keep their keys and an object store's chunks and metadata make its objects
readable again. Sequence numbers and timestamps are new (an entry's TTL counts from the
restore). The ``Nats-Expected-*`` headers of a conditional write are dropped: they name
sequences of the old stream.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from auth import budgets, limits, store
from bus_schemas import subjects
from jobs import background, background_index, batches, files, response_store
from router import adapters, routing
from services import aliases, audit
from services.config import Settings, kv_replicas
from telemetry import records
from tokenbus.cli import bus

FORMAT = "tokenbus-backup"
VERSION = 1
API = "$JS.API"


@dataclass(frozen=True)
class Store:
    """One store: ``kind`` kv, objects or stream; ``name`` the bucket's or the stream's."""

    kind: str
    name: str

    @property
    def stream(self) -> str:
        return {"kv": f"KV_{self.name}", "objects": f"OBJ_{self.name}"}.get(self.kind, self.name)


# Every store tokenbus keeps in JetStream. A new bucket or stream goes here (or in SKIPPED,
# with the reason): tests/test_backup.py fails until it does.
STORES: tuple[Store, ...] = (
    Store("kv", store.BUCKET),  # API keys (hashed)
    Store("kv", budgets.BUCKET),  # spend and holds per key, owner and period; owners' budgets
    Store("kv", limits.SECRETS_BUCKET),  # the rate limiters' shared signing key
    Store("kv", aliases.BUCKET),  # run-time model aliases
    Store("kv", routing.BUCKET),  # run-time routing
    Store("kv", adapters.BUCKET),  # LoRA adapters loaded at run time (the wanted ones)
    Store("kv", response_store.BUCKET),  # stored responses (Responses API)
    Store("kv", background_index.BUCKET),  # the listing of background responses
    Store("kv", batches.BATCHES),  # batch records
    Store("kv", batches.OPEN_BATCHES),  # the batches not yet finished
    Store("kv", batches.BY_OWNER),  # each key's batches
    Store("kv", batches.RESULTS),  # batch lines' results not yet in the output file
    Store("objects", files.BUCKET),  # Files API: batch input and output files
    Store("objects", response_store.LARGE_BUCKET),  # stored responses too large for KV
    Store("objects", batches.WORK_LARGE_BUCKET),  # the bodies of the batch work below past 1 MiB
    Store("stream", audit.STREAM),  # the audit trail
    Store("stream", batches.STREAM),  # batch lines and background responses still to run
    Store("stream", background.EVENTS_STREAM),  # background responses' events
    Store("stream", records.STREAM),  # per-request usage records (telemetry)
    Store("stream", subjects.SPEND_STREAM),  # usage reports whose spend is not settled yet
)
# In JetStream but not backed up, and why.
SKIPPED: dict[str, str] = {
    limits.BUCKET: "the rate limiters' windows: in memory, a minute's worth, rebuilt by traffic",
    subjects.BODIES_STREAM: "large requests' bodies in flight: deleted when each request ends "
    "and expired within 15 minutes (docs/large-requests.md); a restored one would name no "
    "request",
}

# Headers of a conditional publish: they name sequences of the stream they were written to.
_EXPECT = "nats-expected-"
_PUBLISH_WINDOW = 256  # publishes in flight at once while restoring (one connection: in order)


class BadBackup(Exception):
    """The folder is not a whole tokenbus backup (missing, cut short, altered)."""


# -- the JetStream API --------------------------------------------------------------------------
async def _api(nc: NATS, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    payload = json.dumps(body).encode() if body is not None else b""
    msg = await nc.request(f"{API}.{subject}", payload, timeout=10)
    resp = json.loads(msg.data)
    err = resp.get("error")
    if err:
        if err.get("code") == 404:
            raise NotFoundError(code=404, err_code=err.get("err_code"), description=str(err))
        raise RuntimeError(f"JetStream {subject}: {err.get('description') or err}")
    return dict(resp)


async def _info(nc: NATS, stream: str) -> dict[str, Any] | None:
    """The stream's info (config and state), None when it does not exist."""
    try:
        return await _api(nc, f"STREAM.INFO.{stream}")
    except NotFoundError:
        return None


async def _next(nc: NATS, stream: str, seq: int) -> dict[str, Any] | None:
    """The stream's first message at or after ``seq`` (its leader answers), None: none."""
    try:
        resp = await _api(nc, f"STREAM.MSG.GET.{stream}", {"seq": seq, "next_by_subj": ">"})
    except NotFoundError:
        return None
    return dict(resp["message"])


def _headers(raw: str | None) -> dict[str, str]:
    """The headers of a stored message (base64 of ``NATS/1.0\\r\\nK: V\\r\\n...``)."""
    if not raw:
        return {}
    out: dict[str, str] = {}
    for line in base64.b64decode(raw).decode(errors="replace").split("\r\n")[1:]:
        k, sep, v = line.partition(":")
        if sep and k:
            out[k.strip()] = v.strip()
    return out


# -- backup -------------------------------------------------------------------------------------
async def backup(nc: NATS, out: Path, *, log: Any = print) -> dict[str, Any]:
    """Copy every store of :data:`STORES` into ``out`` (which must not exist or be empty);
    the manifest."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    part = out.with_name(out.name + ".partial")
    if part.exists():
        shutil.rmtree(part)
    part.mkdir(parents=True)
    started = time.time()
    # Every stream's last sequence first: the point everything acknowledged before it is in.
    infos = {s.stream: await _info(nc, s.stream) for s in STORES}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "created_at": started,
        "server": {"version": str(getattr(nc, "_server_info", {}).get("version", ""))},
        "streams": [],
        "skipped": SKIPPED,
    }
    for s in STORES:
        info = infos[s.stream]
        if info is None:
            manifest["streams"].append({"stream": s.stream, "kind": s.kind, "absent": True})
            continue
        folder = part / s.stream
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(info["config"], indent=2) + "\n")
        t0 = time.monotonic()
        count, size, digest = await _copy(nc, s.stream, info, folder / "messages.jsonl")
        manifest["streams"].append(
            {
                "stream": s.stream,
                "kind": s.kind,
                "name": s.name,
                "messages": count,
                "bytes": size,
                "sha256": digest,
            }
        )
        log(f"{s.stream}: {count} messages, {size} bytes in {time.monotonic() - t0:.2f}s")
    manifest["seconds"] = round(time.time() - started, 3)
    (part / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    part.rename(out)
    return manifest


async def _copy(nc: NATS, stream: str, info: dict[str, Any], path: Path) -> tuple[int, int, str]:
    """The stream's messages from its first to the snapshot point into ``path`` (JSONL):
    (messages, data bytes, SHA-256 of the file)."""
    state = info["state"]
    stop = int(state.get("last_seq", 0))
    extended = False
    seq = max(int(state.get("first_seq", 1)), 1)
    count = size = 0
    h = hashlib.sha256()
    with path.open("wb") as fh:
        while stop and seq <= stop:
            msg = await _next(nc, stream, seq)
            if msg is not None and int(msg["seq"]) > stop and not extended:
                # Past the snapshot point: an entry written again since then has its new
                # value beyond it (its old one is gone). Read on to the end as it is now.
                extended = True
                now = await _info(nc, stream)
                stop = int(now["state"]["last_seq"]) if now else stop
            if msg is None or int(msg["seq"]) > stop:
                break
            data = msg.get("data") or ""
            line = {
                "seq": int(msg["seq"]),
                "subject": msg["subject"],
                "headers": _headers(msg.get("hdrs")),
                "data": data,
            }
            raw = (json.dumps(line, separators=(",", ":")) + "\n").encode()
            fh.write(raw)
            h.update(raw)
            count += 1
            size += len(base64.b64decode(data)) if data else 0
            seq = int(msg["seq"]) + 1
    return count, size, h.hexdigest()


# -- restore ------------------------------------------------------------------------------------
def read_manifest(src: Path) -> dict[str, Any]:
    """The backup's manifest once every file it names is there and whole (BadBackup)."""
    mpath = src / "manifest.json"
    if not src.is_dir():
        raise BadBackup(f"no backup at {src}: not a folder")
    if not mpath.is_file():
        raise BadBackup(f"no backup at {src}: it has no manifest.json")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadBackup(f"{mpath} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BadBackup(f"{mpath} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise BadBackup(f"{mpath}: version {manifest.get('version')!r}, this reads {VERSION}")
    for entry in manifest.get("streams", []):
        if entry.get("absent"):
            continue
        folder = src / str(entry.get("stream", ""))
        for name in ("config.json", "messages.jsonl"):
            if not (folder / name).is_file():
                raise BadBackup(f"{folder / name} is missing")
        try:
            json.loads((folder / "config.json").read_text())
        except ValueError as exc:
            raise BadBackup(f"{folder / 'config.json'} is not JSON: {exc}") from None
        h = hashlib.sha256()
        with (folder / "messages.jsonl").open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        if h.hexdigest() != entry.get("sha256"):
            raise BadBackup(f"{folder / 'messages.jsonl'} is not the file backed up (checksum)")
    return manifest


def _messages(path: Path) -> Iterator[dict[str, Any]]:
    """The messages of a ``messages.jsonl``, one at a time (a file store's may be GiBs)."""
    with path.open("rb") as fh:
        for n, line in enumerate(fh, 1):
            try:
                msg = json.loads(line)
                yield {
                    "subject": str(msg["subject"]),
                    "headers": dict(msg.get("headers") or {}),
                    "data": base64.b64decode(msg.get("data") or "", validate=True),
                }
            except (ValueError, KeyError, TypeError) as exc:
                raise BadBackup(f"{path}:{n}: not a message ({exc})") from None


def _config(saved: dict[str, Any], replicas: int) -> dict[str, Any]:
    cfg = {k: v for k, v in saved.items() if k not in ("placement", "sealed")}
    cfg["num_replicas"] = replicas
    meta = {k: v for k, v in (cfg.get("metadata") or {}).items() if not k.startswith("_nats.")}
    if meta:
        cfg["metadata"] = meta
    else:
        cfg.pop("metadata", None)
    return cfg


async def restore(
    nc: NATS,
    src: Path,
    *,
    force: bool = False,
    replicas: int | None = None,
    log: Any = print,
) -> dict[str, int]:
    """Put the backup in ``src`` back on the bus: messages restored per stream. Raises
    BadBackup (nothing touched) or FileExistsError (streams with messages, no ``force``)."""
    manifest = read_manifest(src)
    entries = [e for e in manifest.get("streams", []) if not e.get("absent")]
    # Every file read and checked before the bus is touched.
    loaded: dict[str, dict[str, Any]] = {}
    for e in entries:
        folder = src / e["stream"]
        if sum(1 for _ in _messages(folder / "messages.jsonl")) != e.get("messages"):
            raise BadBackup(f"{e['stream']}: the manifest counts another number of messages")
        loaded[e["stream"]] = json.loads((folder / "config.json").read_text())
    existing = {name: await _info(nc, name) for name in loaded}
    full = [n for n, i in existing.items() if i is not None and i["state"].get("messages", 0)]
    if full and not force:
        raise FileExistsError(
            "these streams exist and hold messages: " + ", ".join(sorted(full)) + " (restore "
            "onto an empty bus, or --force to delete them and restore the backup's)"
        )
    reps = replicas if replicas is not None else kv_replicas()
    done: dict[str, int] = {}
    for name, saved in loaded.items():
        info = existing[name]
        if info is not None and name in full:
            await _api(nc, f"STREAM.DELETE.{name}")
            info = None
        if info is None:
            await _api(nc, f"STREAM.CREATE.{name}", _config(saved, reps))
            await _until_led(nc, name)
        t0 = time.monotonic()
        done[name] = await _publish(nc, name, _messages(src / name / "messages.jsonl"))
        log(f"{name}: {done[name]} messages restored in {time.monotonic() - t0:.2f}s")
    return done


async def _until_led(nc: NATS, stream: str, timeout: float = 30.0) -> None:
    """Until the stream just made has a leader (bounded): a replicated stream elects one
    after its create has answered, and a publish before that gets no answer ("no response
    from stream", a restore onto a fresh cluster failed so once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # no leader yet: the info has no answer either
            info = await _info(nc, stream)
            if info is not None and (info.get("cluster") or {}).get("leader", "one server"):
                return
        await asyncio.sleep(0.1)


async def _publish(nc: NATS, stream: str, msgs: Iterator[dict[str, Any]]) -> int:
    """Publish ``msgs`` to ``stream`` in order, each acknowledged: how many."""
    js = nc.jetstream()
    count = 0

    async def one(m: dict[str, Any]) -> None:
        hdrs = {k: v for k, v in m["headers"].items() if not k.lower().startswith(_EXPECT)}
        await js.publish(m["subject"], m["data"], headers=hdrs or None, stream=stream)

    while window := list(itertools.islice(msgs, _PUBLISH_WINDOW)):
        # Started in order on one connection, so stored in order.
        await asyncio.gather(*(one(m) for m in window))
        count += len(window)
    return count


# -- the commands -------------------------------------------------------------------------------
def add_parsers(sub: Any) -> None:
    b = sub.add_parser(
        "backup",
        help="copy every tokenbus store in JetStream (keys, spend, aliases, routing, stored "
        "responses, files, batches, audit trail) into a folder, while the stack serves",
    )
    b.add_argument("--out", required=True, help="the folder to write (missing or empty)")
    r = sub.add_parser("restore", help="put a `tokenbus backup` folder back on an empty bus")
    r.add_argument("--from", dest="src", required=True, help="the backup folder")
    r.add_argument(
        "--force",
        action="store_true",
        help="delete streams of the backup that exist with messages, then restore them",
    )
    r.add_argument(
        "--replicas",
        type=int,
        help="copies of each restored stream (default: kv_replicas, TOKENBUS_KV_REPLICAS)",
    )


async def run(args: argparse.Namespace, settings: Settings) -> int:
    src = Path(args.src) if args.cmd == "restore" else None
    if src is not None:
        try:  # a bad backup is said before anything connects
            read_manifest(src)
        except BadBackup as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.cmd == "restore" and args.replicas is not None and args.replicas < 1:
        print("error: --replicas must be 1 or more", file=sys.stderr)
        return 2
    nc = await bus.connect(settings.url(), settings.nats_auth())
    if nc is None:
        return 1
    try:
        if src is None:
            out = Path(args.out)
            t0 = time.monotonic()
            m = await backup(nc, out)
            kept = [s for s in m["streams"] if not s.get("absent")]
            total = sum(s["bytes"] for s in kept)
            print(
                f"backed up {len(kept)} streams, {sum(s['messages'] for s in kept)} messages, "
                f"{total} bytes of data into {out} in {time.monotonic() - t0:.2f}s"
            )
            return 0
        done = await restore(nc, src, force=args.force, replicas=args.replicas)
        print(f"restored {len(done)} streams, {sum(done.values())} messages from {src}")
        return 0
    except BadBackup as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"error: {args.cmd} failed: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    finally:
        await nc.drain()

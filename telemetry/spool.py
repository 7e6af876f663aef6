"""A process's journal of the messages it handed to a stream and has no ack for yet.

A worker's usage record and spend report leave ahead of the answer's final frame, then
wait in the process for their stream's ack, tried again for up to a minute (a stream whose
leader was lost answers nothing for seconds). A process killed in that minute (its host
crashed, its container was replaced) loses what was waiting, unless it was written down:
with ``telemetry.spool_dir`` set, each message is appended to a file of this process's own
before it is handed to the bus (one ``write``: in the operating system when the final frame
leaves, so a killed process has it), and an ack is appended when it comes. The file is
synced to disk every :data:`SYNC_EVERY_S` (a machine that loses power loses at most that).

A process starting with the same directory takes every file no live process holds (each is
locked by its writer while it runs: ``flock``), sends again what was never acknowledged
(with its message id: the stream's duplicate window drops what did arrive; past it, the
telemetry store keeps one row per request and a hold settles once), and removes those
files once it has copied what they still owe into its own.

Each entry: a 4-byte big-endian length, then msgpack ``[kind, msg_id, subject, n, data]``
(kind ``m``: a message, ``n`` records in it, 0 for a spend report on ``subject``; kind
``a``: its ack). A torn last entry (a process killed mid-write) ends the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgpack

from services import lockfiles
from services import logging as tlog

SYNC_EVERY_S = 1.0
# Past this size a file is written anew with only what it still owes (under steady load
# something is always owed, so waiting for an empty debt would let it grow for good).
COMPACT_BYTES = 1 << 20
_LEN = struct.Struct(">I")
log = tlog.get("telemetry")


@dataclass
class Entry:
    """A message that waits for its stream's ack."""

    msg_id: str
    subject: str  # "" for the records' own subject
    n: int  # records in it; 0: a spend report
    data: bytes


def read_entries(path: Path) -> list[Entry]:
    """The messages of a spool file without an ack, in the order they were written."""
    owed: dict[str, Entry] = {}
    try:
        raw = path.read_bytes()
    except OSError:
        return []
    pos = 0
    while pos + _LEN.size <= len(raw):
        (size,) = _LEN.unpack_from(raw, pos)
        body = raw[pos + _LEN.size : pos + _LEN.size + size]
        if len(body) < size:
            break  # torn by a kill mid-write
        pos += _LEN.size + size
        try:
            kind, msg_id, subject, n, data = msgpack.unpackb(body)
        except Exception:
            break
        if kind == "m":
            owed[str(msg_id)] = Entry(str(msg_id), str(subject), int(n), bytes(data))
        elif kind == "a":
            owed.pop(str(msg_id), None)
    return list(owed.values())


def _message(e: Entry) -> list[object]:
    return ["m", e.msg_id, e.subject, e.n, e.data]


def _frame(entry: list[object]) -> bytes:
    """One entry as the file holds it: its length, then its msgpack."""
    body: bytes = msgpack.packb(entry, use_bin_type=True)
    return _LEN.pack(len(body)) + body


class Spool:
    """This process's spool file in ``directory`` (one per process: ``<name>-<id>.spool``)."""

    def __init__(self, directory: str | Path, name: str) -> None:
        self.dir = Path(directory)
        self.name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "process"
        self.path = self.dir / f"{self.name}-{uuid.uuid4().hex[:8]}.spool"
        self._fd = -1
        self._owed: dict[str, Entry] = {}  # what the file holds without its ack
        self._size = 0
        self.dirty = False

    def open(self) -> list[Entry]:
        """Create this process's file; take the files of processes that are gone and return
        what they still owe (already copied into this file, so a crash now loses none)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fd = lockfiles.hold(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        owed: list[Entry] = []
        for other, fd in lockfiles.gone(self.dir, "*.spool", self.path):
            left = read_entries(other)
            for e in left:
                self.put(e)
            owed += left
            os.fsync(self._fd)
            with contextlib.suppress(OSError):
                # Unless the name is now another file: its owner wrote it anew meanwhile
                # (this one had been replaced, and holds nothing that one does not).
                if os.stat(other).st_ino == os.fstat(fd).st_ino:
                    other.unlink()
        if owed:
            log.info("spool_replay", messages=len(owed), records=sum(e.n for e in owed))
        return owed

    def _append(self, entry: list[object]) -> None:
        if self._fd < 0:
            return
        data = _frame(entry)
        try:
            os.write(self._fd, data)
        except OSError as exc:  # a full disk: the message still goes to the bus
            log.warning("spool_write_failed", error=repr(exc))
            return
        self._size += len(data)
        self.dirty = True

    def put(self, e: Entry) -> None:
        """Write ``e`` down before it is handed to the bus."""
        self._owed[e.msg_id] = e
        self._append(_message(e))

    def acked(self, msg_id: str) -> None:
        """Its stream has it; past :data:`COMPACT_BYTES`, the file is written anew."""
        if self._owed.pop(msg_id, None) is None:
            return
        self._append(["a", msg_id, "", 0, b""])
        if self._size >= COMPACT_BYTES and self._fd >= 0:
            with contextlib.suppress(OSError):
                self._compact()

    def _compact(self) -> None:
        """Write what is owed to a new file (locked, synced), then put it in this file's
        place: a crash at any point leaves one of the two, each holding all that is owed."""
        data = b"".join(_frame(_message(e)) for e in self._owed.values())
        tmp = self.path.with_suffix(".compacting")  # not a spool file to a starting process
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.replace(tmp, self.path)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(self._fd)
        self._fd, self._size = fd, len(data)

    def sync(self) -> None:
        """On disk (called every :data:`SYNC_EVERY_S` from a thread, off the event loop)."""
        if self._fd >= 0 and self.dirty:
            self.dirty = False
            with contextlib.suppress(OSError):
                os.fsync(self._fd)

    @property
    def owed(self) -> int:
        return len(self._owed)

    def close(self) -> None:
        """Closed; removed when nothing is owed (else the next process sends it)."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.fsync(self._fd)
        if not self._owed:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = -1

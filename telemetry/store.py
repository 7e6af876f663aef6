"""Per-request records on local disk: one SQLite file, bounded, queryable, kept across
restarts.

SQLite because it is in the standard library, a single file an operator can query with any
SQL tool (``sqlite3 .tokenbus/telemetry.db "select model, avg(ttft_ms) ..."``), safe for one
writer with readers alongside (WAL), and fast enough for batched inserts of thousands of
rows a second; Parquet would need pyarrow and is awkward to append to row by row.

Records of one request from several sources (the worker's, the bridge's) merge into one row:
a later record fills the columns it knows. The table keeps at most ``max_rows`` rows, the
oldest deleted first.

Writes are idempotent: each record's id (:func:`telemetry.records.record_id`) is kept in
``record_ids`` in the same transaction as its merge, and a record whose id is there already
is skipped. A record delivered again (the stream redelivers what was not acknowledged, a
publisher's retry) is never counted twice.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

COLUMNS = (
    "request_id",
    "client_request_id",  # the client's own label (X-Request-Id); request_id is the gateway's
    "ts_ns",
    "source",
    "model",
    "replica",
    "principal",
    "kind",
    "outcome",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "migrations",
    "trace_id",
    "usage_source",
    "ttft_ms",
    "tbt_ms",
    "e2e_ms",
    "gateway_ms",
    "engine_ms",
    "prefill_ms",
    "decode_ms",
    "relay_ms",
    "stages",
    "t",
)
_JSON = {"stages", "t"}
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS requests (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    {", ".join(c + (" TEXT UNIQUE" if c == "request_id" else "") for c in COLUMNS)}
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests(ts_ns);
CREATE TABLE IF NOT EXISTS record_ids (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    record_id TEXT UNIQUE NOT NULL
);
"""
# Record ids kept per stored row (a request has one to three records): far more than any
# redelivery needs, which comes within the consumer's ack wait.
IDS_PER_ROW = 4


def record_id(r: dict[str, Any]) -> str | None:
    """As :func:`telemetry.records.record_id` (kept here so the store imports no NATS)."""
    rid = r.get("record_id")
    if isinstance(rid, str) and rid:
        return rid
    req = r.get("request_id")
    if not isinstance(req, str) or not req:
        return None
    source, migrations = r.get("source"), r.get("migrations")
    # Only what a record of a publisher holds: a value of another type (a list nested deep
    # enough to fail formatting) names nothing.
    source = source if isinstance(source, str) else ""
    migrations = migrations if isinstance(migrations, int) else 0
    return f"{req}/{source}/{migrations}"


def _row(r: dict[str, Any]) -> tuple[Any, ...] | None:
    """``r`` as a row; None when it has no request id or a value SQLite cannot take (one
    such record would fail the whole batch it is written with)."""
    if not r.get("request_id"):
        return None
    row: list[Any] = []
    for c in COLUMNS:
        v = r.get(c)
        if c in _JSON and v is not None:
            try:
                v = json.dumps(v)
            except (TypeError, ValueError, RecursionError):
                return None
        elif not _scalar(v):
            return None
        row.append(v)
    return tuple(row)


def _scalar(v: Any) -> bool:
    """Whether SQLite stores ``v`` as it is (integers up to 64 bits)."""
    if isinstance(v, int):
        return -(2**63) <= v < 2**63
    return v is None or isinstance(v, str | float)


# A record from the HTTP side is the fuller one, and a later attempt of a migrated request is
# the one that finished it: their values win; otherwise a value fills only what is still empty.
WINS = (
    "excluded.source = 'http' OR "
    "(requests.source <> 'http' AND "
    "COALESCE(excluded.migrations, 0) > COALESCE(requests.migrations, 0))"
)
MERGE = ", ".join(
    f"{c} = CASE WHEN {WINS} THEN COALESCE(excluded.{c}, requests.{c}) "
    f"ELSE COALESCE(requests.{c}, excluded.{c}) END"
    for c in COLUMNS
    if c != "request_id"
)


class RecordStore:
    """The SQLite store (one writer: the telemetry service; readers: ``tokenbus report``)."""

    def __init__(self, path: str | Path, max_rows: int = 1_000_000) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_rows = max_rows
        self.db = sqlite3.connect(self.path, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        # A store written by an older version: add the columns it lacks.
        have = {row[1] for row in self.db.execute("PRAGMA table_info(requests)")}
        for c in COLUMNS:
            if c not in have:
                self.db.execute(f"ALTER TABLE requests ADD COLUMN {c}")
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    def write(self, recs: Iterable[dict[str, Any]]) -> int:
        """Insert or merge records (by request id), each once (by record id); trims the oldest
        beyond ``max_rows``. The records applied now (not seen before)."""
        items = [(record_id(r), row) for r in recs if (row := _row(r)) is not None]
        if not items:
            return 0
        cols = ", ".join(COLUMNS)
        marks = ", ".join("?" for _ in COLUMNS)
        upsert = (
            f"INSERT INTO requests ({cols}) VALUES ({marks}) "
            f"ON CONFLICT(request_id) DO UPDATE SET {MERGE}"
        )
        n = 0
        with self.db:
            for rid, row in items:
                if rid is not None:
                    cur = self.db.execute(
                        "INSERT OR IGNORE INTO record_ids (record_id) VALUES (?)", (rid,)
                    )
                    if cur.rowcount == 0:
                        continue  # stored before: a redelivery
                self.db.execute(upsert, row)
                n += 1
            self._trim()
        return n

    def _trim(self) -> None:
        (n,) = self.db.execute("SELECT COUNT(*) FROM requests").fetchone()
        if n > self.max_rows:
            self.db.execute(
                "DELETE FROM requests WHERE seq IN (SELECT seq FROM requests ORDER BY seq LIMIT ?)",
                (n - self.max_rows,),
            )
        self.db.execute(
            "DELETE FROM record_ids WHERE seq <= (SELECT MAX(seq) FROM record_ids) - ?",
            (self.max_rows * IDS_PER_ROW,),
        )

    def count(self) -> int:
        (n,) = self.db.execute("SELECT COUNT(*) FROM requests").fetchone()
        return int(n)

    def rows(self, since_ns: int = 0) -> Iterator[dict[str, Any]]:
        cur = self.db.execute(
            f"SELECT {', '.join(COLUMNS)} FROM requests WHERE ts_ns >= ? ORDER BY ts_ns",
            (since_ns,),
        )
        for row in cur:
            rec = dict(zip(COLUMNS, row, strict=True))
            for c in _JSON:
                if rec[c]:
                    rec[c] = json.loads(rec[c])
            yield rec


# -- PostgreSQL -----------------------------------------------------------------------------

_PG_INT = {"ts_ns", "status", "prompt_tokens", "completion_tokens", "migrations"}
_PG_FLOAT = {c for c in COLUMNS if c.endswith("_ms")}


def _pg_type(c: str) -> str:
    if c == "request_id":
        return "TEXT UNIQUE"
    return "BIGINT" if c in _PG_INT else "DOUBLE PRECISION" if c in _PG_FLOAT else "TEXT"


_PG_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS requests (seq BIGSERIAL PRIMARY KEY, "
    + ", ".join(f"{c} {_pg_type(c)}" for c in COLUMNS)
    + ")",
    "CREATE INDEX IF NOT EXISTS requests_ts ON requests(ts_ns)",
    "CREATE TABLE IF NOT EXISTS record_ids "
    "(seq BIGSERIAL PRIMARY KEY, record_id TEXT UNIQUE NOT NULL)",
    # A store written by an older version: the columns it lacks.
    *(f"ALTER TABLE requests ADD COLUMN IF NOT EXISTS {c} {_pg_type(c)}" for c in COLUMNS[1:]),
]


def _pg_value(c: str, v: Any) -> Any:
    """``v`` as column ``c`` of the PostgreSQL table takes it (columns are typed there, where
    SQLite takes any value): a value of another type is left out (NULL), never failing the
    batch it came with; text loses NUL characters, which PostgreSQL does not store."""
    if v is None:
        return None
    if c in _PG_INT:
        return v if isinstance(v, int) and not isinstance(v, bool) else None
    if c in _PG_FLOAT:
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
    return (v if isinstance(v, str) else str(v)).replace("\x00", "")


def open_store(cfg: Any) -> RecordStore | PgRecordStore:
    """The store ``cfg`` (``telemetry`` settings) selects: SQLite or PostgreSQL."""
    if cfg.store == "postgres":
        return PgRecordStore(cfg.postgres_dsn, cfg.max_rows)
    return RecordStore(cfg.db_path, cfg.max_rows)


def is_dsn(where: str | Path) -> bool:
    """Whether ``where`` names a PostgreSQL database rather than a SQLite file."""
    return str(where).startswith(("postgresql://", "postgres://"))


class PgRecordStore:
    """The same table, merge and idempotence as :class:`RecordStore`, in PostgreSQL
    (``telemetry.store = "postgres"``; psycopg 3, the ``postgres`` extra). Several telemetry
    services may write to one database: the record ids' unique key holds across them."""

    def __init__(self, dsn: str, max_rows: int = 1_000_000) -> None:
        import psycopg  # the postgres extra: only where this store is chosen

        if not dsn:
            raise ValueError("telemetry.postgres_dsn is empty (telemetry.store = postgres)")
        self.dsn = dsn
        self.path = _redacted(dsn)  # what logs show: no password
        self.max_rows = max_rows
        self.db = psycopg.connect(dsn, autocommit=True)
        with self.db.transaction():
            # One schema maker at a time (two services starting together).
            self.db.execute("SELECT pg_advisory_xact_lock(7346184)")
            for stmt in _PG_SCHEMA:
                self.db.execute(stmt)
        self._upsert = (
            f"INSERT INTO requests ({', '.join(COLUMNS)}) "
            f"VALUES ({', '.join('%s' for _ in COLUMNS)}) "
            f"ON CONFLICT (request_id) DO UPDATE SET {MERGE}"
        )

    def close(self) -> None:
        self.db.close()

    def write(self, recs: Iterable[dict[str, Any]]) -> int:
        """As :meth:`RecordStore.write`. A row PostgreSQL refuses (which the typing above
        should leave none of) is skipped alone, not with its batch."""
        import psycopg

        items = [
            (record_id(r), tuple(_pg_value(c, v) for c, v in zip(COLUMNS, row, strict=True)))
            for r in recs
            if (row := _row(r)) is not None
        ]
        if not items:
            return 0
        try:
            with self.db.transaction():
                return self._write(items)
        except (psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError):
            n = 0
            for item in items:
                with (
                    contextlib.suppress(
                        psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError
                    ),
                    self.db.transaction(),
                ):
                    n += self._write([item])
            return n

    def _write(self, items: list[tuple[str | None, tuple[Any, ...]]]) -> int:
        n = 0
        for rid, row in items:
            if rid is not None:
                cur = self.db.execute(
                    "INSERT INTO record_ids (record_id) VALUES (%s) ON CONFLICT DO NOTHING",
                    (rid,),
                )
                if cur.rowcount == 0:
                    continue  # stored before: a redelivery
            self.db.execute(self._upsert, row)
            n += 1
        (count,) = self.db.execute("SELECT COUNT(*) FROM requests").fetchone() or (0,)
        if count > self.max_rows:
            self.db.execute(
                "DELETE FROM requests WHERE seq IN "
                "(SELECT seq FROM requests ORDER BY seq LIMIT %s)",
                (count - self.max_rows,),
            )
        self.db.execute(
            "DELETE FROM record_ids WHERE seq <= (SELECT MAX(seq) FROM record_ids) - %s",
            (self.max_rows * IDS_PER_ROW,),
        )
        return n

    def count(self) -> int:
        (n,) = self.db.execute("SELECT COUNT(*) FROM requests").fetchone() or (0,)
        return int(n)

    def rows(self, since_ns: int = 0) -> Iterator[dict[str, Any]]:
        cur = self.db.execute(
            f"SELECT {', '.join(COLUMNS)} FROM requests WHERE ts_ns >= %s ORDER BY ts_ns",
            (since_ns,),
        )
        for row in cur.fetchall():
            rec = dict(zip(COLUMNS, row, strict=True))
            for c in _JSON:
                if rec[c]:
                    rec[c] = json.loads(rec[c])
            yield rec


def _redacted(dsn: str) -> str:
    """``dsn`` without its password (``postgresql://user:***@host/db``)."""
    head, sep, tail = dsn.partition("@")
    if not sep or "://" not in head:
        return dsn
    scheme, _, cred = head.partition("://")
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}" if ":" in cred else dsn

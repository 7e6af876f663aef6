"""Per-request records on local disk: one SQLite file, bounded, queryable, kept across
restarts.

SQLite because it is in the standard library, a single file an operator can query with any
SQL tool (``sqlite3 .tokenbus/telemetry.db "select model, avg(ttft_ms) ..."``), safe for one
writer with readers alongside (WAL), and fast enough for batched inserts of thousands of
rows a second; Parquet would need pyarrow and is awkward to append to row by row.

Records of one request from several sources (the worker's, the bridge's) merge into one row:
a later record fills the columns it knows. The table keeps at most ``max_rows`` rows, the
oldest deleted first.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

COLUMNS = (
    "request_id",
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
"""


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
        """Insert or merge records (by request id); trims the oldest beyond ``max_rows``."""
        rows = [row for r in recs if (row := _row(r)) is not None]
        if not rows:
            return 0
        cols = ", ".join(COLUMNS)
        marks = ", ".join("?" for _ in COLUMNS)
        # A record from the HTTP side is the fuller one, and a later attempt of a migrated
        # request is the one that finished it: their values win; otherwise a value fills
        # only what is still empty.
        wins = (
            "excluded.source = 'http' OR "
            "(source <> 'http' AND COALESCE(excluded.migrations, 0) > COALESCE(migrations, 0))"
        )
        merge = ", ".join(
            f"{c} = CASE WHEN {wins} THEN COALESCE(excluded.{c}, {c}) "
            f"ELSE COALESCE({c}, excluded.{c}) END"
            for c in COLUMNS
            if c != "request_id"
        )
        with self.db:
            self.db.executemany(
                f"INSERT INTO requests ({cols}) VALUES ({marks}) "
                f"ON CONFLICT(request_id) DO UPDATE SET {merge}",
                rows,
            )
            self._trim()
        return len(rows)

    def _trim(self) -> None:
        (n,) = self.db.execute("SELECT COUNT(*) FROM requests").fetchone()
        if n > self.max_rows:
            self.db.execute(
                "DELETE FROM requests WHERE seq IN (SELECT seq FROM requests ORDER BY seq LIMIT ?)",
                (n - self.max_rows,),
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

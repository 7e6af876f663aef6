"""The Spend page's view of a usage read (gateway/console_usage.py), shaped in the bridge so
that a month of 10 000 keys is a page of rows and a chart of nine series, not every row.

- the table: sums per key and model over the period, the most costly first; a page of them
  (``offset``, ``limit``) and how many there are;
- the chart: per bucket, the :data:`TOP_KEYS` keys with the most of the chosen measure and
  one series, :data:`OTHERS`, for the rest together;
- the period's totals;
- one key alone (``key``): its rows, its series and its totals (the budget lines' view).

The export (CSV) is the read's every row per bucket, key and model: :meth:`Usage.csv_chunks`.
A :class:`Summaries` cache keeps a read's summary :data:`CACHE_S` seconds, per period, bucket
and set of keys a session may see, where making it was slow, bounded by :data:`CACHE_ROWS`
rows in all: reading and decoding the stream is most of a request's time (docs/console.md,
"Speed"), and the page's paging, measure and key filter reuse one read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from gateway.console_usage import FIELDS, Sums, Usage, as_nums

TOP_KEYS = 8
OTHERS = "(others)"  # not a key id: those are 12 hex digits
MEASURES = ("cost_usd", "tokens", "requests")
CACHE_S = 5.0
CACHE_MIN_S = 0.2  # a summary made faster than this is not kept: the page shows the newest
CACHE_ROWS = 400_000  # rows (bucket, key, model) kept in all; a larger read is not kept


def _measure(a: list[float], m: str) -> float:
    """One of :data:`MEASURES` of sums ``[requests, prompt, completion, cost]``."""
    return a[1] + a[2] if m == "tokens" else a[FIELDS.index(m)]


def _acc(into: dict[Any, list[float]], at: Any, s: Sums) -> None:
    a = into.get(at)
    if a is None:
        into[at] = [s["requests"], s["prompt_tokens"], s["completion_tokens"], s["cost_usd"]]
    else:
        a[0] += s["requests"]
        a[1] += s["prompt_tokens"]
        a[2] += s["completion_tokens"]
        a[3] += s["cost_usd"]


def _nums(a: list[float]) -> dict[str, float | int]:
    return as_nums(dict(zip(FIELDS, a, strict=True)))


@dataclass
class Summary:
    """A usage read indexed for the page: sums per key and model (the costliest first), per
    key, and per bucket for all keys (as lists ``[requests, prompt, completion, cost]``)."""

    usage: Usage
    made: float = field(default_factory=time.monotonic)
    table: list[tuple[str, str, list[float]]] = field(default_factory=list)
    by_key: dict[str, list[float]] = field(default_factory=dict)
    per_t: dict[int, list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, usage: Usage) -> Summary:
        """Index ``usage`` (CPU work: run it off the event loop)."""
        out = cls(usage)
        pairs: dict[tuple[str, str], list[float]] = {}
        for (t, k, m), s in usage.rows.items():
            _acc(pairs, (k, m), s)
            _acc(out.per_t, t, s)
        for (k, _m), a in pairs.items():
            b = out.by_key.get(k)
            if b is None:
                out.by_key[k] = list(a)
            else:
                for i, v in enumerate(a):
                    b[i] += v
        out.table = [(k, m, a) for (k, m), a in pairs.items()]
        out.table.sort(key=lambda r: (-r[2][3], -r[2][0], r[0], r[1]))
        return out

    def view(self, key: str | None, measure: str, offset: int, limit: int) -> dict[str, Any]:
        """The page's JSON: a page of the table, the chart's series and the totals."""
        u = self.usage
        others: list[str] = []
        if key is None:
            table = self.table
            ranked = sorted(self.by_key, key=lambda k: (-_measure(self.by_key[k], measure), k))
            keys, others = ranked[:TOP_KEYS], ranked[TOP_KEYS:]
        else:
            table = [r for r in self.table if r[0] == key]
            keys = [key] if key in self.by_key else []
        totals = [0, 0, 0, 0.0]
        for k in self.by_key if key is None else keys:
            totals = [x + y for x, y in zip(totals, self.by_key[k], strict=True)]
        top = set(keys)
        mine: dict[tuple[str, int], list[float]] = {}
        for (t, k, _m), s in u.rows.items():
            if k in top:
                _acc(mine, (k, t), s)
        order = {k: i for i, k in enumerate(keys)}
        series = [
            {"t": t, "key_id": k, **_nums(a)}
            for (k, t), a in sorted(mine.items(), key=lambda i: (order[i[0][0]], i[0][1]))
        ]
        if others:  # all keys less the top ones, per bucket
            for t, a in sorted(self.per_t.items()):
                rest = list(a)
                for k in keys:
                    rest = [
                        x - y for x, y in zip(rest, mine.get((k, t), (0, 0, 0, 0.0)), strict=True)
                    ]
                if rest[0] > 0:
                    rest[3] = max(0.0, rest[3])
                    series.append({"t": t, "key_id": OTHERS, **_nums(rest)})
        page = table[offset : offset + limit]
        return {
            "object": "usage",
            "since": u.since,
            "bucket_s": u.bucket_s,
            "records": u.records,
            "truncated": u.truncated,
            "age_s": round(time.monotonic() - self.made, 1),
            "data": [{"key_id": k, "model": m, **_nums(a)} for k, m, a in page],
            "total": len(table),
            "offset": offset,
            "limit": limit,
            "has_more": offset + len(page) < len(table),
            "totals": _nums(totals),
            "chart": {"measure": measure, "keys": keys, "others": len(others), "series": series},
        }


class Summaries:
    """Summaries kept :data:`CACHE_S` seconds per (period, bucket, visible keys) where one
    took :data:`CACHE_MIN_S` or more to make, at most :data:`CACHE_ROWS` rows in all;
    requests for one that is being made wait for it."""

    def __init__(
        self, ttl_s: float = CACHE_S, max_rows: int = CACHE_ROWS, min_s: float = CACHE_MIN_S
    ) -> None:
        self.ttl_s = ttl_s
        self.max_rows = max_rows
        self.min_s = min_s
        self._kept: dict[Hashable, Summary] = {}
        self._making: dict[Hashable, asyncio.Future[Summary]] = {}  # tasks being made

    async def get(self, key: Hashable, make: Callable[[], Awaitable[Summary]]) -> Summary:
        """The kept summary for ``key`` while fresh, else the one ``make`` returns. ``make``
        runs in a task of its own: a client that leaves does not stop it for the others."""
        now = time.monotonic()
        for k in [k for k, s in self._kept.items() if now - s.made > self.ttl_s]:
            del self._kept[k]
        if key in self._kept:
            return self._kept[key]
        task = self._making.get(key)
        if task is None:
            task = self._making[key] = asyncio.ensure_future(make())
            task.add_done_callback(lambda t: self._made(key, t, now))
        return await asyncio.shield(task)

    def _made(self, key: Hashable, task: asyncio.Future[Summary], started: float) -> None:
        del self._making[key]
        if task.cancelled() or task.exception() is not None:  # each waiter gets the error
            return
        if time.monotonic() - started >= self.min_s:
            self._keep(key, task.result())

    def _keep(self, key: Hashable, got: Summary) -> None:
        size = len(got.usage.rows)
        if size > self.max_rows:
            return
        while self._kept and size + sum(len(s.usage.rows) for s in self._kept.values()) > (
            self.max_rows
        ):
            del self._kept[next(iter(self._kept))]  # the oldest first
        self._kept[key] = got

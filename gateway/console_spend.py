"""The Spend page's view of a usage read (gateway/console_usage.py), shaped in the bridge so
that a month of 10 000 keys is a page of rows and a chart of nine series, not every row.

- the table: sums per key and model over the period, the most costly first; a page of them
  (``offset``, ``limit``) and how many there are;
- the chart: per bucket, the :data:`TOP_KEYS` keys with the most of the chosen measure and
  one series, :data:`OTHERS`, for the rest together;
- the period's totals;
- one key alone (``key``): its rows, its series and its totals (the budget lines' view);
- the same grouped by owner (:meth:`Summary.by_owner`): a row per owner, the chart's top
  owners, and one owner alone (its owner budget's lines' view).

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
NO_OWNER = ""  # the owner group of keys without an owner (no owner is named ""), by_owner
GROUPS = ("key", "owner")
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
        page = table[offset : offset + limit]
        return {
            **self._head(),
            "group": "key",
            "data": [{"key_id": k, "model": m, **_nums(a)} for k, m, a in page],
            **self._paged(len(table), len(page), offset, limit),
            "totals": _nums(totals),
            "chart": {
                "measure": measure,
                "keys": keys,
                "others": len(others),
                "series": self._series("key_id", keys, bool(others), OTHERS, lambda k: k),
            },
        }

    def by_owner(
        self,
        owner_of: Callable[[str], str],
        owner: str | None,
        measure: str,
        offset: int,
        limit: int,
    ) -> dict[str, Any]:
        """The page's JSON grouped by owner (``owner_of`` a key's, :data:`NO_OWNER` for a key
        without one): a page of owners' sums (every key and model of each), the chart's
        top owners and the rest together (``"owner": null``), the totals; ``owner`` narrows
        it to that owner. Made from this summary's sums per key: no second read."""
        groups: dict[str, list[float]] = {}
        keys_in: dict[str, int] = {}
        for k, a in self.by_key.items():
            g = owner_of(k)
            b = groups.get(g)
            if b is None:
                groups[g] = list(a)
            else:
                for i, v in enumerate(a):
                    b[i] += v
            keys_in[g] = keys_in.get(g, 0) + 1
        others: list[str] = []
        if owner is None:
            table = sorted(groups, key=lambda g: (-groups[g][3], -groups[g][0], g))
            ranked = sorted(groups, key=lambda g: (-_measure(groups[g], measure), g))
            top, others = ranked[:TOP_KEYS], ranked[TOP_KEYS:]
        else:
            table = top = [owner] if owner in groups else []
        totals = [0, 0, 0, 0.0]
        for g in groups if owner is None else top:
            totals = [x + y for x, y in zip(totals, groups[g], strict=True)]
        page = table[offset : offset + limit]
        return {
            **self._head(),
            "group": "owner",
            "data": [{"owner": g, "keys": keys_in[g], **_nums(groups[g])} for g in page],
            **self._paged(len(table), len(page), offset, limit),
            "totals": _nums(totals),
            "chart": {
                "measure": measure,
                "owners": top,
                "others": len(others),
                "series": self._series("owner", top, bool(others), None, owner_of),
            },
        }

    def _head(self) -> dict[str, Any]:
        u = self.usage
        return {
            "object": "usage",
            "since": u.since,
            "bucket_s": u.bucket_s,
            "records": u.records,
            "truncated": u.truncated,
            "age_s": round(time.monotonic() - self.made, 1),
        }

    @staticmethod
    def _paged(total: int, n: int, offset: int, limit: int) -> dict[str, Any]:
        return {"total": total, "offset": offset, "limit": limit, "has_more": offset + n < total}

    def _series(
        self,
        label: str,
        top: list[str],
        rest: bool,
        rest_name: str | None,
        group_of: Callable[[str], str],
    ) -> list[dict[str, Any]]:
        """The chart's series: the sums per bucket of each of ``top`` (groups of keys by
        ``group_of``) in that order, then, with ``rest``, of everything else together as
        ``rest_name``; each named in the field ``label``."""
        chosen = set(top)
        mine: dict[tuple[str, int], list[float]] = {}
        for (t, k, _m), s in self.usage.rows.items():
            g = group_of(k)
            if g in chosen:
                _acc(mine, (g, t), s)
        order = {g: i for i, g in enumerate(top)}
        series: list[dict[str, Any]] = [
            {"t": t, label: g, **_nums(a)}
            for (g, t), a in sorted(mine.items(), key=lambda i: (order[i[0][0]], i[0][1]))
        ]
        if rest:  # all less the top ones, per bucket
            for t, a in sorted(self.per_t.items()):
                left = list(a)
                for g in top:
                    left = [
                        x - y for x, y in zip(left, mine.get((g, t), (0, 0, 0, 0.0)), strict=True)
                    ]
                if left[0] > 0:
                    left[3] = max(0.0, left[3])
                    series.append({"t": t, label: rest_name, **_nums(left)})
        return series


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

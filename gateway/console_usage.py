"""The console's usage view: per-request records read back from the ``TOKENBUS_USAGE``
stream (telemetry/records.py) and summed per key, model and hour or day.

The stream keeps every record the bridges and workers publish for
``telemetry.stream_max_age_s`` (7 days by default), so this is data the bus already has;
nothing is added to the request path. A request has a worker's record and, over HTTP, the
bridge's: each request is counted once (by its request id, the record with the most tokens).
A read is bounded: at most :data:`MAX_RECORDS` messages of records, the newest window first
when there are more (``truncated`` says so), and a JetStream consumer that lives only for the
read; the messages come back undecoded and are decoded one at a time as they are summed
(:func:`records_of`), so a month is never a list of every record. What the page draws of a
read is gateway/console_spend.py's.
Cost is the key's spend at the models' configured prices (``router.price``,
``router.models.<m>.price``), as the budgets charge it.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from auth import budgets
from bus_schemas import codec
from bus_schemas import errors as E
from services import buckets
from services.config import PriceSettings
from telemetry import records

MAX_RECORDS = 200_000
MAX_SPAN_S = 31 * 86400.0
FETCH = 512
TIMEOUT_S = 5.0
BUCKETS = {"hour": 3600, "day": 86400}
COLUMNS = (
    "bucket_start_utc",
    "key_id",
    "owner",
    "model",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cost_usd",
)


FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cost_usd")
CSV_CHUNK = 2000  # rows per body message of the export
Sums = dict[str, float]


def zero() -> Sums:
    """Sums of nothing."""
    return {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}


def as_nums(s: Sums) -> dict[str, float | int]:
    """Sums as JSON numbers: counts as integers, cost rounded to a millionth of a dollar."""
    return {n: _num(v) for n, v in s.items()}


@dataclass
class Usage:
    """What a read found: rows ``(bucket start, key, model) -> sums`` and how it was read."""

    since: float
    bucket_s: int
    rows: dict[tuple[int, str, str], Sums] = field(default_factory=dict)
    records: int = 0
    truncated: bool = False

    def csv_chunks(self, owner_of: Callable[[str], str]) -> Iterator[bytes]:
        """Every row as CSV (:data:`COLUMNS`), :data:`CSV_CHUNK` rows a chunk, in order;
        ``owner_of`` says a key's owner (empty for none)."""
        out = io.StringIO()
        w = csv.writer(out)
        w.writerow(COLUMNS)
        for i, ((t, k, m), s) in enumerate(sorted(self.rows.items()), 1):
            when = dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            counts = [int(s[c]) for c in ("requests", "prompt_tokens", "completion_tokens")]
            w.writerow(
                [when, _cell(k), _cell(owner_of(k)), _cell(m), *counts, f"{s['cost_usd']:.6f}"]
            )
            if i % CSV_CHUNK == 0:
                yield out.getvalue().encode()
                out.seek(0)
                out.truncate()
        if out.tell():
            yield out.getvalue().encode()


def _num(v: float) -> float | int:
    return int(v) if float(v).is_integer() else round(v, 6)


def _cell(text: str) -> str:
    """A CSV cell a spreadsheet will not run as a formula (a key name is a tenant's text)."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def summarize(
    recs: Iterable[dict[str, Any]],
    since: float,
    bucket_s: int,
    price: Callable[[str], PriceSettings | None],
    keep: Callable[[str], bool] | None = None,
) -> Usage:
    """Sum records into buckets; each request once (its record with the most tokens). Only
    the keys ``keep`` says yes to (all where it is None)."""
    best: dict[str, tuple[int, str, str, int, int]] = {}
    n = 0
    for r in recs:
        n += 1
        rid, key = r.get("request_id"), r.get("principal") or ""
        if not isinstance(rid, str) or not isinstance(key, str):
            continue
        if keep is not None and not keep(key):
            continue
        ts = int(r.get("ts_ns") or 0) // 1_000_000_000
        if ts < since:
            continue
        p, c = int(r.get("prompt_tokens") or 0), int(r.get("completion_tokens") or 0)
        seen = best.get(rid)
        if seen is None or p + c > seen[3] + seen[4] or (not seen[1] and key):
            best[rid] = (ts, key or (seen[1] if seen else ""), str(r.get("model") or ""), p, c)
    out = Usage(since=since, bucket_s=bucket_s, records=n)
    rows = out.rows
    prices: dict[str, PriceSettings | None] = {}  # a model's price, looked up once a read
    for ts, key, model, p, c in best.values():
        if model not in prices:
            prices[model] = price(model)
        at = (ts - ts % bucket_s, key or "(none)", model)
        row = rows.get(at)
        if row is None:
            row = rows[at] = zero()
        row["requests"] += 1
        row["prompt_tokens"] += p
        row["completion_tokens"] += c
        row["cost_usd"] += budgets.cost(prices[model], p, c) / 1e6
    return out


def records_of(messages: Iterable[bytes]) -> Iterator[Any]:
    """The records of the stream's messages, one message decoded at a time (an unreadable
    one is skipped)."""
    for data in messages:
        try:
            found = records.batch(codec.decode_map(data))
        except Exception:
            continue
        yield from found


async def read_messages(
    nc: NATS, since: float, most: int = MAX_RECORDS
) -> tuple[list[bytes], bool]:
    """The messages stored at or after ``since`` (Unix time), at most ``most`` of them (the
    newest: True says some older ones were left out), undecoded (:func:`records_of`). No
    stream: none."""
    js = nc.jetstream(timeout=TIMEOUT_S)
    try:
        info = await js.stream_info(records.STREAM)
    except NotFoundError:
        return [], False
    except Exception:
        raise E.ServiceUnavailable("the usage records (JetStream) are not reachable") from None
    if not info.state.messages:
        return [], False
    name = f"console-usage-{uuid.uuid4().hex[:12]}"
    cfg = ConsumerConfig(
        name=name,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
        mem_storage=True,
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=dt.datetime.fromtimestamp(since, dt.UTC),
    )
    left = (await js.add_consumer(records.STREAM, config=cfg)).num_pending or 0
    truncated = left > most
    if truncated:  # start at the newest ``most`` messages instead
        await js.delete_consumer(records.STREAM, name)
        cfg.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        cfg.opt_start_time = None
        cfg.opt_start_seq = max(info.state.first_seq, info.state.last_seq - most + 1)
        left = (await js.add_consumer(records.STREAM, config=cfg)).num_pending or 0
    out: list[bytes] = []
    await buckets.read_consumer(
        js,
        records.STREAM,
        name,
        left,
        lambda msgs: out.extend(m.data for m in msgs),
        timeout=TIMEOUT_S,
        batch=FETCH,
    )
    return out, truncated

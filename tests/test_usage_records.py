"""Usage records that survive (docs/telemetry.md, "Durability"): the JetStream stream keeps
them through a telemetry outage, a killed telemetry service loses none, and none is stored
twice (redelivery, two services sharing the consumer). Real nats-servers, real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import nats
import pytest
from nats.aio.client import Client as NATS

from bus_schemas import codec
from services.buckets import open_stream
from services.natsconf import role_login
from telemetry import records
from telemetry.service import Telemetry
from telemetry.store import PgRecordStore
from tests.lockedbus import LockedBus
from tests.support.inprocess import settings
from tests.support.natsserver import NatsServer, spawn_nats
from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.waits import wait_for
from tokenbus.evaluation.report import report


def rec(rid: str, source: str = "worker", **kw: Any) -> dict[str, Any]:
    return records.build(
        request_id=rid,
        source=source,
        model="m",
        timings={"t0": time.time_ns()},
        outcome="length",
        completion_tokens=3,
        **kw,
    )


async def publish(
    nc: NATS, rids: list[str], source: str = "worker", *, alone: bool = False
) -> records.Recorder:
    """``rids``' records through a recorder (``alone``: one message each), once the stream
    acknowledged every message."""
    recorder = records.Recorder(nc)
    for rid in rids:
        recorder.add(rec(rid, source))
        if alone:
            recorder._send()
    recorder._send()
    await wait_for(
        lambda: recorder.acked == recorder.messages,
        timeout=20,
        what="the stream did not acknowledge every message",
    )
    assert recorder.failed == 0
    return recorder


def stored(db: Path, prefix: str = "") -> int:
    """Rows (requests) in the store file ``db`` whose request id starts with ``prefix``."""
    if not db.exists():
        return 0
    con = sqlite3.connect(db, timeout=5)
    try:
        (n,) = con.execute(
            "SELECT COUNT(*) FROM requests WHERE request_id LIKE ?", (f"{prefix}%",)
        ).fetchone()
        return int(n)
    except sqlite3.OperationalError:  # the service has not made its tables yet
        return 0
    finally:
        con.close()


def counted(tel: Telemetry, source: str = "worker") -> float:
    """Records the service counted in its metrics."""
    return float(tel.metrics.records.labels(source)._value.get())


def cfg(db: Path, **kw: Any) -> dict[str, Any]:
    return {"db_path": str(db), "metrics_port": 0, "flush_interval_s": 0.1,
            "probe_interval_s": 0, **kw}  # fmt: skip


@contextlib.asynccontextmanager
async def telemetry(url: str, db: Path, **kw: Any) -> AsyncIterator[Telemetry]:
    svc = Telemetry(settings(url, telemetry=cfg(db, **kw)))
    async with svc:
        assert svc.durable
        yield svc


@contextlib.asynccontextmanager
async def connection(url: str) -> AsyncIterator[NATS]:
    nc = await nats.connect(url)
    try:
        yield nc
    finally:
        await nc.drain()


async def consumer_settled(nc: NATS) -> bool:
    info = await nc.jetstream().consumer_info(records.STREAM, records.CONSUMER)
    return bool(info.num_pending == 0 and info.num_ack_pending == 0)


async def wait_settled(nc: NATS, timeout: float = 20) -> None:
    """Until the consumer has delivered everything and had every message acknowledged."""
    deadline = time.monotonic() + timeout
    while not await consumer_settled(nc):
        assert time.monotonic() < deadline, "the consumer did not settle"
        await asyncio.sleep(0.05)


@pytest.mark.bus
async def test_records_published_during_an_outage_are_all_stored_once_it_starts(
    private_nats: NatsServer, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    async with connection(private_nats.url) as nc:
        # No telemetry service ever ran on this bus: the recorder makes the stream itself.
        await publish(nc, [f"a{i}" for i in range(500)])
        async with telemetry(private_nats.url, db) as tel:
            await wait_for(lambda: stored(db, "a") == 500, timeout=20, what="500 stored")
            await wait_settled(nc)
            assert tel.written == 500 and counted(tel) == 500
        # Down again: what comes meanwhile waits for the next one.
        await publish(nc, [f"b{i}" for i in range(300)])
        assert stored(db) == 500
        async with telemetry(private_nats.url, db) as tel:
            await wait_for(lambda: stored(db, "b") == 300, timeout=20, what="300 more")
            await wait_settled(nc)
            assert tel.written == 300 and counted(tel) == 300
        assert stored(db) == 800


@pytest.mark.fault
async def test_a_service_started_while_the_stream_answers_nothing_binds_it_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Started while its bus has no JetStream to answer (here: a server without it, then one
    # with it on the same port, as a node comes back or a stream elects its leader), the
    # service takes records over core NATS, tries the stream again, and once bound
    # consumes it durably: what was published before stays in the stream until stored.
    from telemetry import service

    monkeypatch.setattr(service, "BIND_RETRY_S", 0.2)
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    bare = spawn_nats(port, "-a", "127.0.0.1", "-p", str(port))
    srv: NatsServer | None = None
    db = tmp_path / "t.db"
    try:
        async with Telemetry(settings(url, telemetry=cfg(db))) as tel:
            assert not tel.durable
            bare.terminate()
            bare.wait(10)
            srv = NatsServer(tmp_path / "js", port=port).start()
            await wait_for(lambda: tel.durable, timeout=30, what="the consumer bound")
            async with connection(url) as nc:
                await publish(nc, [f"late{i}" for i in range(20)])
                await wait_for(lambda: stored(db, "late") == 20, timeout=20, what="20 stored")
                await wait_settled(nc)
    finally:
        if bare.poll() is None:
            bare.kill()
        if srv is not None:
            srv.stop()


@pytest.mark.fault
async def test_a_killed_telemetry_service_loses_no_record_and_stores_none_twice(
    private_nats: NatsServer, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    env = {
        "TOKENBUS_TELEMETRY__DB_PATH": str(db),
        "TOKENBUS_TELEMETRY__METRICS_PORT": "0",
        "TOKENBUS_TELEMETRY__FLUSH_INTERVAL_S": "0.2",
        "TOKENBUS_TELEMETRY__PROBE_INTERVAL_S": "0",
        # What the killed one fetched and never acknowledged comes back this soon.
        "TOKENBUS_TELEMETRY__ACK_WAIT_S": "2",
    }
    total = 1400  # the first 700 one a message: 400 written, 300 in the buffer at the kill
    # The first one writes when 400 records wait, or after a minute: the last of them stay
    # in its buffer, fetched and unacknowledged, when it is killed.
    first = {
        **env,
        "TOKENBUS_TELEMETRY__MAX_BUFFER": "400",
        "TOKENBUS_TELEMETRY__FLUSH_INTERVAL_S": "60",
    }
    with Procs(private_nats.url, tmp_path) as procs:
        tel = procs.start("telemetry", "serve", "telemetry", env=first)
        await wait_for(lambda: "service_started" in tel.output(), timeout=30, what="started")
        async with connection(private_nats.url) as nc:
            js = nc.jetstream()
            # Worker and bridge records of every request: one row each, merged.
            await publish(nc, [f"k{i}" for i in range(total // 2)], alone=True)
            deadline = time.monotonic() + 20
            while True:  # every record fetched, some written, some waiting in its buffer
                info = await js.consumer_info(records.STREAM, records.CONSUMER)
                if info.num_pending == 0 and info.num_ack_pending > 0 and stored(db, "k") > 0:
                    break
                assert time.monotonic() < deadline, (
                    info.num_pending,
                    info.num_ack_pending,
                    stored(db, "k"),
                )
                await asyncio.sleep(0.05)
            tel.signal(signal.SIGKILL)
            tel.proc.wait(10)
            at_kill = stored(db, "k")
            await publish(nc, [f"k{i}" for i in range(total // 2)], source="http")
            await publish(nc, [f"k{i}" for i in range(total // 2, total)])
            again = procs.start("telemetry2", "serve", "telemetry", env=env)
            await wait_for(lambda: stored(db, "k") == total, timeout=40, what="all stored")
            await wait_settled(nc)
            assert again.alive()
        assert 0 < at_kill < total // 2
    con = sqlite3.connect(db)
    (ids,) = con.execute("SELECT COUNT(*) FROM record_ids").fetchone()
    merged = con.execute(
        "SELECT COUNT(*) FROM requests WHERE source = 'http' AND completion_tokens = 3"
    ).fetchone()[0]
    con.close()
    assert ids == total // 2 * 3  # every record, once
    assert merged == total // 2  # the bridge's record won its request's row


@pytest.mark.bus
async def test_two_telemetry_services_share_the_consumer_and_count_each_record_once(
    private_nats: NatsServer, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    async with (
        connection(private_nats.url) as nc,
        telemetry(private_nats.url, db) as one,
        telemetry(private_nats.url, db) as two,
    ):
        for chunk in range(4):
            await publish(nc, [f"c{chunk}-{i}" for i in range(500)])
        await wait_for(lambda: stored(db, "c") == 2000, timeout=30, what="2000 stored")
        await wait_settled(nc)
        assert one.written + two.written == 2000
        assert counted(one) + counted(two) == 2000


@pytest.mark.bus
async def test_a_redelivered_record_is_not_counted_twice(
    private_nats: NatsServer, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    async with (
        connection(private_nats.url) as nc,
        telemetry(private_nats.url, db, ack_wait_s=1) as tel,
    ):
        # The service stores the records but its acks are lost: the stream sends them again.
        lost: list[Any] = []
        tel._ack = lost.append  # type: ignore[method-assign,assignment]
        await publish(nc, [f"r{i}" for i in range(100)])
        await wait_for(lambda: stored(db, "r") == 100, timeout=20, what="stored")
        first = len(lost)
        await wait_for(lambda: len(lost) > first, timeout=20, what="no redelivery")
        del tel._ack  # acks go out again
        await wait_settled(nc)
        assert stored(db, "r") == 100
        assert tel.written == 100 and counted(tel) == 100
        info = await nc.jetstream().consumer_info(records.STREAM, records.CONSUMER)
        # Deliveries (the consumer's sequence) outnumber the messages: some came twice.
        assert info.delivered.consumer_seq > info.delivered.stream_seq


@pytest.mark.bus
async def test_a_malformed_record_is_acked_and_counted_as_dropped(
    private_nats: NatsServer, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    async with (
        connection(private_nats.url) as nc,
        telemetry(private_nats.url, db) as tel,
    ):
        js = nc.jetstream()
        subject = records.subject()
        junk = [
            b"\xc1 not msgpack",
            msgpack.packb([1, 2, 3]),
            codec.encode({"records": [1, "x", None]}),
            codec.encode({**rec("neg"), "prompt_tokens": -5}),
            # a source nested 1000 lists deep: too deep to format, let alone to label
            msgpack.packb({**rec("deep"), "source": "DEEP"}).replace(
                msgpack.packb("DEEP"), b"\x91" * 1000 + b"\xc0"
            ),
        ]
        for data in junk:
            await js.publish(subject, data)
        await publish(nc, ["good"])
        await wait_for(lambda: stored(db, "good") == 1, timeout=20, what="stored after junk")
        await wait_settled(nc)
        # undecodable (1), not a map (1: the list is one message), three entries, a bad
        # value, a source too deep
        assert tel.metrics.dropped._value.get() == 7
        assert not tel.stopped.is_set()


@pytest.mark.stack
async def test_a_record_the_stream_does_not_acknowledge_is_counted_overdue_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bus without JetStream: nothing keeps the records, and the recorder says so: overdue
    # past PUBLISH_FOR_S, still tried (not given up, not raised).
    monkeypatch.setattr(records, "PUBLISH_BACKOFF_S", (0.01,))
    monkeypatch.setattr(records, "PUBLISH_FOR_S", 0.2)
    monkeypatch.setattr(records, "PUBLISH_SLOW_S", 0.05)
    port = free_port()
    proc = spawn_nats(port, "-a", "127.0.0.1", "-p", str(port))
    try:
        async with connection(f"nats://127.0.0.1:{port}") as nc:
            before = records.PUBLISH_OVERDUE._value.get()
            recorder = records.Recorder(nc)
            for i in range(5):
                recorder.add(rec(f"x{i}"))
            recorder._send()
            await wait_for(lambda: recorder.overdue == 1, timeout=30, what="counted overdue")
            assert records.PUBLISH_OVERDUE._value.get() - before == 1  # one message of five
            tries = recorder.retries
            await wait_for(lambda: recorder.retries > tries + 2, timeout=30, what="tried on")
            assert recorder.failed == 0
    finally:
        proc.terminate()
        proc.wait(10)


async def _a_record_and_a_report(nc: Any, request_id: str) -> tuple[records.Recorder, str]:
    """A worker's recorder that sent a usage record and a spend report of ``request_id``;
    with the spend subject."""
    from bus_schemas import subjects

    recorder = records.Recorder(nc)
    recorder._made_stream = True  # as a worker on the locked bus: it may not make it
    recorder.add(rec(request_id))
    spend = subjects.usage_spend("limiter-a")
    recorder.send_first(spend, codec.encode({"request_id": request_id, "spend": "x"}))
    await recorder.send_now()
    return recorder, spend


@pytest.mark.bus
async def test_records_and_a_spend_report_overdue_for_minutes_still_land_once(
    private_nats: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 71: a site cut off from the hub for longer than the recorder's quick tries
    (PUBLISH_FOR_S, a minute; here shrunk) delivers its records and spend reports when the
    streams can be reached again, each once (before, they were given up and lost)."""
    from auth.ratelimit import spend_stream_config
    from bus_schemas import subjects

    monkeypatch.setattr(records, "PUBLISH_BACKOFF_S", (0.02,))
    monkeypatch.setattr(records, "PUBLISH_FOR_S", 0.2)
    monkeypatch.setattr(records, "PUBLISH_SLOW_S", 0.1)
    async with connection(private_nats.url) as nc:
        js = nc.jetstream()
        recorder, _ = await _a_record_and_a_report(nc, "cut-1")
        await wait_for(lambda: recorder.overdue == 2, timeout=20, what="both overdue")
        tries = recorder.retries
        await wait_for(lambda: recorder.retries > tries + 4, timeout=20, what="tried on")
        await open_stream(js, records.stream_config())
        await open_stream(js, spend_stream_config())
        await wait_for(lambda: recorder.acked == 2, timeout=20, what="both acknowledged")
        assert recorder.overdue == 0 and recorder.failed == 0 and recorder.failed_reports == 0
        for stream in (records.STREAM, subjects.SPEND_STREAM):
            assert (await js.stream_info(stream)).state.messages == 1, stream


@pytest.mark.bus
async def test_a_record_and_a_spend_report_wait_out_a_stream_without_a_leader(
    private_nats: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stream whose leader was lost answers nothing useful for the seconds an election
    # takes (4 to 9 s in nats-server, longer while a restarted node catches up): here the
    # streams are missing for as many tries as the recorder once made in all (4), and both
    # messages land once the streams are there, each once.
    from auth.ratelimit import spend_stream_config
    from bus_schemas import subjects

    monkeypatch.setattr(records, "PUBLISH_BACKOFF_S", (0.05,))
    async with connection(private_nats.url) as nc:
        js = nc.jetstream()
        recorder, spend = await _a_record_and_a_report(nc, "late-1")
        await wait_for(lambda: recorder.retries >= 12, timeout=20, what="tries without a stream")
        await open_stream(js, records.stream_config())
        await open_stream(js, spend_stream_config())
        await wait_for(lambda: recorder.acked == 2, timeout=20, what="both acknowledged")
        assert recorder.failed == 0 and recorder.failed_reports == 0
        for stream in (records.STREAM, subjects.SPEND_STREAM):
            assert (await js.stream_info(stream)).state.messages == 1, stream
        kept = await js.get_last_msg(subjects.SPEND_STREAM, spend)
        assert codec.decode_map(kept.data)["request_id"] == "late-1"


CHILD = """
import asyncio, sys
import nats
from bus_schemas import codec, subjects
from telemetry import records
from telemetry.spool import Spool

async def main() -> None:
    nc = await nats.connect(sys.argv[1])
    r = await records.Recorder(nc, Spool(sys.argv[2], "worker-spooled")).open()
    r._made_stream = True  # as a worker on the locked bus: it may not make the stream
    r.add({"request_id": "spooled-1", "source": "worker"})
    r.send_first(subjects.usage_spend("limiter-a"), codec.encode({"request_id": "spooled-1"}))
    await r.send_now()
    print("handed to the bus", flush=True)
    await asyncio.Event().wait()  # until killed

asyncio.run(main())
"""


@pytest.mark.unit
def test_a_spool_under_steady_load_stays_small_and_keeps_what_it_owes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under load something always waits for its ack, so the file never empties: past its
    # bound it is written anew with only what it owes, and still holds all of that.
    from telemetry import spool as sp

    monkeypatch.setattr(sp, "COMPACT_BYTES", 4096)
    s = sp.Spool(tmp_path, "worker-busy")
    assert s.open() == []
    blob = b"x" * 200
    for i in range(500):
        s.put(sp.Entry(f"m{i}", "", 1, blob))
        if i >= 2:
            s.acked(f"m{i - 2}")  # two always in flight
    assert s.path.stat().st_size < 3 * 4096
    assert [e.msg_id for e in sp.read_entries(s.path)] == ["m498", "m499"]
    s.close()
    assert s.path.exists()  # still owes two: the next process sends them
    nxt = sp.Spool(tmp_path, "worker-next")
    assert [e.msg_id for e in nxt.open()] == ["m498", "m499"]
    assert not s.path.exists()
    nxt.close()


@pytest.mark.fault
async def test_what_a_killed_process_had_not_had_acknowledged_is_sent_by_the_next(
    private_nats: NatsServer, tmp_path: Path
) -> None:
    # A worker hands its record and spend report to the bus while their streams answer
    # nothing (here: not made yet), and is killed -9 while it waits for the acks. With a
    # spool, the next process on the same directory sends both, once.
    from auth.ratelimit import spend_stream_config
    from bus_schemas import subjects
    from telemetry.spool import Spool, read_entries

    spool_dir = tmp_path / "spool"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        private_nats.url,
        str(spool_dir),
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 30)
        assert line.strip() == b"handed to the bus"
        [left] = list(spool_dir.glob("*.spool"))
        assert {e.n for e in read_entries(left)} == {0, 1}  # the report and the record
    finally:
        child.kill()
        await child.wait()
    async with connection(private_nats.url) as nc:
        js = nc.jetstream()
        await open_stream(js, records.stream_config())
        await open_stream(js, spend_stream_config())
        recorder = await records.Recorder(nc, Spool(spool_dir, "worker-next")).open()
        await wait_for(lambda: recorder.acked == 2, timeout=30, what="both sent again")
        for stream in (records.STREAM, subjects.SPEND_STREAM):
            assert (await js.stream_info(stream)).state.messages == 1, stream
        kept = await js.get_last_msg(records.STREAM, records.subject())
        assert codec.decode_map(kept.data)["request_id"] == "spooled-1"
        assert not left.exists()  # taken over, and nothing more owed in this one's
        assert recorder.spool is not None and recorder.spool.owed == 0
        await recorder.flush()
    assert list(spool_dir.glob("*.spool")) == []


@pytest.mark.stack
async def test_on_the_locked_bus_workers_publish_and_telemetry_consumes_durably(
    tmp_path: Path,
) -> None:
    # The roles' permissions carry it: the worker reads the stream's acks under its own
    # inbox root only, the telemetry role makes the stream and its consumer and fetches.
    bus = LockedBus(tmp_path / "bus").start()
    db = tmp_path / "t.db"
    try:
        login = role_login(bus.users, "telemetry")
        tel_settings = settings(
            bus.url, nats_user=login["user"], nats_password=login["password"], telemetry=cfg(db)
        )
        tel = Telemetry(tel_settings)
        async with tel:
            assert tel.durable
        worker = await nats.connect(bus.url, **role_login(bus.users, "worker"))
        try:
            await publish(worker, [f"w{i}" for i in range(200)])  # while no service runs
        finally:
            await worker.drain()
        tel = Telemetry(tel_settings)
        async with tel:
            # Both: the rows are committed in the writer's thread a moment before the
            # service counts them.
            await wait_for(
                lambda: stored(db, "w") == 200 and tel.written == 200,
                timeout=20,
                what="200 stored, each once",
            )
    finally:
        bus.stop()


# -- the PostgreSQL store ------------------------------------------------------------------


def _postgres_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    return found[-1].parent if found else None


@pytest.fixture
def postgres() -> Iterator[str]:
    """A real PostgreSQL (Debian's ``postgresql`` package) in a folder of its own, on a free
    port; the test is skipped where there is none, or no psycopg."""
    psycopg = pytest.importorskip("psycopg")
    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server (apt-get install postgresql)")
    user: dict[str, Any] = {}
    folder = Path(tempfile.mkdtemp(prefix="tb-pg-"))
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and no postgres user to run PostgreSQL as")
        os.chown(folder, pw.pw_uid, pw.pw_gid)
        user = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
    data, port = folder / "data", free_port()
    log = open(folder / "postgres.log", "wb")  # noqa: SIM115 - closed below
    proc: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run(
            [bindir / "initdb", "-D", data, "-A", "trust", "-U", "postgres", "--no-sync"],
            check=True, stdout=log, stderr=subprocess.STDOUT, **user,
        )  # fmt: skip
        proc = subprocess.Popen(
            [bindir / "postgres", "-D", data, "-p", str(port), "-k", folder,
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
            stdout=log, stderr=subprocess.STDOUT, **user,
        )  # fmt: skip
        dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        deadline = time.monotonic() + 30
        while True:  # it listens a moment before it takes connections
            try:
                psycopg.connect(dsn, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                assert proc.poll() is None, (folder / "postgres.log").read_text()
                assert time.monotonic() < deadline, "PostgreSQL did not start"
                time.sleep(0.1)
        yield dsn
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.stack
def test_the_postgres_store_merges_stores_once_and_the_report_reads_it(
    postgres: str, tmp_path: Path
) -> None:
    store = PgRecordStore(postgres, max_rows=100)
    assert "postgres@127.0.0.1" in str(store.path)
    w = {"request_id": "a", "source": "worker", "model": "m", "ts_ns": 1, "engine_ms": 5}
    h = {"request_id": "a", "source": "http", "model": "m", "ts_ns": 1, "status": 200}
    assert store.write([w]) == 1 and store.write([h]) == 1
    assert store.write([w, h]) == 0  # delivered again: nothing applied twice
    (row,) = list(store.rows())
    assert row["source"] == "http" and row["engine_ms"] == 5 and row["status"] == 200
    # A value of the wrong type for its column is left out, not the batch with it.
    odd = {"request_id": "odd", "model": 5, "status": "x", "ttft_ms": "y", "ts_ns": 2,
           "kind": "a\x00b", "stages": {"route": 1.5}}  # fmt: skip
    assert store.write([odd, {"request_id": "even", "ts_ns": 3, "model": "m"}]) == 2
    got = {r["request_id"]: r for r in store.rows()}
    assert got["odd"]["model"] == "5" and got["odd"]["status"] is None
    assert got["odd"]["kind"] == "ab" and got["odd"]["stages"] == {"route": 1.5}
    store.write({"request_id": f"r{i}", "ts_ns": 10 + i, "model": "m"} for i in range(250))
    assert store.count() == 100
    store.close()
    summary = report(postgres, tmp_path / "out")
    assert summary["requests"] == 100


@pytest.mark.stack
async def test_telemetry_services_store_into_postgres_each_record_once(
    private_nats: NatsServer, postgres: str, tmp_path: Path
) -> None:
    pg = {"store": "postgres", "postgres_dsn": postgres}
    async with (
        connection(private_nats.url) as nc,
        telemetry(private_nats.url, tmp_path / "unused.db", **pg) as one,
        telemetry(private_nats.url, tmp_path / "unused.db", **pg) as two,
    ):
        await nc.jetstream().publish(records.subject(), b"\xc1 junk")
        for chunk in range(3):
            await publish(nc, [f"p{chunk}-{i}" for i in range(400)])
        await publish(nc, [f"p0-{i}" for i in range(400)], source="http")
        reader = PgRecordStore(postgres)
        try:
            await wait_for(lambda: reader.count() == 1200, timeout=30, what="1200 rows")
            await wait_settled(nc)
            assert one.written + two.written == 1600
            merged = [r for r in reader.rows() if r["request_id"].startswith("p0-")]
            assert len(merged) == 400 and all(r["source"] == "http" for r in merged)
        finally:
            reader.close()
        assert one.metrics.dropped._value.get() + two.metrics.dropped._value.get() == 1


@pytest.mark.fault
async def test_a_worker_killed_as_it_answers_has_sent_the_record_already(
    procs: Procs, model: str
) -> None:
    """The worker's record leaves ahead of the final frame on the same connection
    (engine_worker/outbox.py): killed the moment its caller has the answer, inside what
    used to be the record's 50 ms batch window, it has handed the record to the bus."""
    async with connection(procs.url) as nc:
        js = nc.jetstream()
        await open_stream(js, records.stream_config())
        stack = await start_stack(
            procs, model, worker_args=("--sim-prefill-ms", "2", "--sim-decode-ms", "1")
        )
        worker = stack.workers[0]
        async with stack.openai() as c:
            stream = await c.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hello there"}],
                max_tokens=4,
                stream=True,
            )
            finish = None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                    worker.signal(signal.SIGKILL)  # the answer is out: nothing more leaves
                    break
            assert finish == "length"
        worker.proc.wait(10)
        sub = await js.subscribe(records.subject(), ordered_consumer=True)
        mine: list[dict[str, Any]] = []
        deadline = time.monotonic() + 20
        while not mine:
            assert time.monotonic() < deadline, "the worker's record never reached the stream"
            with contextlib.suppress(nats.errors.TimeoutError):
                msg = await sub.next_msg(timeout=0.5)
                try:  # the stream is shared: other tests' messages, malformed ones too
                    body = codec.decode_map(msg.data)
                except Exception:
                    continue
                recs = body.get("records", [body])
                recs = recs if isinstance(recs, list) else []
                mine += [r for r in recs if isinstance(r, dict) and _worker_record(r, model)]
        await sub.unsubscribe()
    assert len(mine) == 1 and mine[0]["completion_tokens"] == 4 and mine[0]["outcome"] == "length"


def _worker_record(r: dict[str, Any], model: str) -> bool:
    return r.get("model") == model and r.get("source") == "worker"

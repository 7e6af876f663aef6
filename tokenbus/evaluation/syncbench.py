"""``tokenbus bench --sync-cost``: what a JetStream sync policy costs each store tokenbus
writes, measured with the stores' own code on a nats-server of each policy.

For each policy (``--sync-policies``, default ``2m,1s,always``: nats-server's own default, an
interval, and every write synced before its acknowledgement, tokenbus' default), a fresh
nats-server with that policy and a fresh store directory, then:

* **keys:** ``--sync-keys`` keys created one after another (:meth:`auth.store.KeyStore.create`,
  its audit record included): ms per key;
* **budgets:** ``--sync-clients`` concurrent requests on as many keys of one owner, each a
  reservation (admission) and a settlement (the request's end) in its key's budget and the
  owner's
  (:class:`auth.budgets.SpendBook`), ``--sync-rounds`` each: reservations and settlements
  per second, and the p50/p99 of a reservation (what admission waits for);
* **batch:** a batch of ``--sync-lines`` lines as the stores write it: each line queued on
  the work stream and its result written once (:class:`jobs.batches.BatchStore`): lines/s;
* **files:** ``--sync-files`` files of 1 MiB put in the file store
  (:class:`jobs.files.FileStore`): MiB/s.

The figures are the machine's disk's: a sync costs what its fsync costs (docs/deploy.md
quotes them with the disk they were measured on). Request serving end to end is measured
with the ordinary bench and ``--nats-sync`` (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import nats

from services.config import BatchSettings, FilesSettings
from services.natsconf import jetstream_block


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 3) if xs else 0.0


async def _keys(nc: Any, n: int) -> dict[str, Any]:
    from auth.store import KeyStore

    store = await KeyStore(nc).open(watch=False)
    took = []
    for i in range(n):
        t = time.perf_counter()
        await store.create(f"sync-bench-{i}")
        took.append(time.perf_counter() - t)
    await store.close()
    return {
        "keys": n,
        "ms_per_key_p50": _pct(took, 0.5),
        "ms_per_key_p99": _pct(took, 0.99),
        "keys_per_s": round(n / sum(took), 1),
    }


async def _budgets(nc: Any, clients: int, rounds: int) -> dict[str, Any]:
    from auth.budgets import Budget, SpendBook

    book = await SpendBook(nc).open()
    owner = Budget(f"o.bench{time.time_ns()}", "day", 10**12, None)
    reserve_s: list[float] = []
    settle_s: list[float] = []

    async def client(i: int) -> None:
        # Each on its own key's budget and all on one owner's, as keys of one team are:
        # the owner's entry takes every request's changes (grouped: auth.budgets).
        budgets = [Budget(f"k.bench{i}", "day", 10**12, None), owner]
        for r in range(rounds):
            t = time.perf_counter()
            hold = await book.reserve(budgets, f"r{i}-{r}", 1000, time.time() + 60)
            t2 = time.perf_counter()
            await book.settle(hold, 700)
            reserve_s.append(t2 - t)
            settle_s.append(time.perf_counter() - t2)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    for i in range(clients):
        spent, held = await book.spent(Budget(f"k.bench{i}", "day", None, None))
        assert spent == rounds * 700 and held == 0, (i, spent, held)
    spent, held = await book.spent(owner)
    assert spent == clients * rounds * 700 and held == 0, ("owner", spent, held)
    return {
        "clients": clients,
        "requests": clients * rounds,
        "requests_per_s": round(clients * rounds / wall, 1),
        "reserve_ms_p50": _pct(reserve_s, 0.5),
        "reserve_ms_p99": _pct(reserve_s, 0.99),
        "settle_ms_p50": _pct(settle_s, 0.5),
        "settle_ms_p99": _pct(settle_s, 0.99),
    }


async def _batch(nc: Any, lines: int) -> dict[str, Any]:
    from jobs.batches import BatchStore

    store = await BatchStore(nc, BatchSettings(), 3600.0).open()
    batch = f"batch_{uuid.uuid4().hex[:12]}"
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 200}]}
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(64)

    async def line(n: int) -> None:
        async with sem:
            work = {"batch": batch, "n": n, "custom_id": f"c{n}", "url": "/v1/x", "body": body}
            await store.publish(batch, "line", work, f"{batch}.{n}")

    await asyncio.gather(*(line(n) for n in range(lines)))
    queued = time.perf_counter() - t0

    async def result(n: int) -> None:
        async with sem:
            out = {"custom_id": f"c{n}", "response": {"status_code": 200, "body": body}}
            await store.record_result(batch, n, out)

    t1 = time.perf_counter()
    await asyncio.gather(*(result(n) for n in range(lines)))
    answered = time.perf_counter() - t1
    await nc.jetstream().purge_stream("TOKENBUS_BATCH")
    return {
        "lines": lines,
        "queue_s": round(queued, 3),
        "results_s": round(answered, 3),
        "lines_per_s": round(lines / (queued + answered), 1),
    }


async def _files(nc: Any, n: int) -> dict[str, Any]:
    from jobs.files import FileStore

    store = await FileStore(nc, FilesSettings()).open()
    data = b"x" * (1 << 20)
    t0 = time.perf_counter()
    for i in range(n):
        await store.put("", f"f{i}.jsonl", "batch", data)
    wall = time.perf_counter() - t0
    return {"files": n, "mib_per_s": round(n / wall, 1), "ms_per_file": round(wall / n * 1000, 1)}


async def _one(policy: str, a: argparse.Namespace) -> dict[str, Any]:
    from tokenbus.launcher import free_port, nats_server_binary, port_open

    tmp = Path(tempfile.mkdtemp(prefix="tokenbus-sync-"))
    port = free_port()
    conf = tmp / "nats.conf"
    conf.write_text(jetstream_block(str(tmp / "js"), policy))
    proc = await asyncio.create_subprocess_exec(
        nats_server_binary(),
        *("-c", str(conf), "-a", "127.0.0.1", "-p", str(port)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            if port_open("127.0.0.1", port):
                break
            await asyncio.sleep(0.05)
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        try:
            return {
                "policy": policy,
                "keys": await _keys(nc, a.sync_keys),
                "budgets": await _budgets(nc, a.sync_clients, a.sync_rounds),
                "batch": await _batch(nc, a.sync_lines),
                "files": await _files(nc, a.sync_files),
            }
        finally:
            await nc.close()
    finally:
        proc.terminate()
        await proc.wait()


async def run_sync_bench(a: argparse.Namespace) -> int:
    runs = [await _one(p.strip(), a) for p in a.sync_policies.split(",") if p.strip()]
    out: dict[str, Any] = {"bench": "sync-cost", "runs": runs}
    base = next((r for r in runs if r["policy"] == "2m"), None)

    def ratio(r: dict[str, Any], store: str, field: str) -> float:
        assert base is not None
        return round(float(r[store][field]) / max(float(base[store][field]), 1e-9), 2)

    if base is not None:
        out["vs_lazy"] = {
            r["policy"]: {
                "keys_ms_p50": ratio(r, "keys", "ms_per_key_p50"),
                "budget_requests_per_s": ratio(r, "budgets", "requests_per_s"),
                "reserve_ms_p50": ratio(r, "budgets", "reserve_ms_p50"),
                "batch_lines_per_s": ratio(r, "batch", "lines_per_s"),
                "files_mib_per_s": ratio(r, "files", "mib_per_s"),
            }
            for r in runs
        }
    text = json.dumps(out, indent=2)
    if getattr(a, "out", None):
        Path(a.out).write_text(text + "\n")
    print(text)
    for r in runs:
        print(
            f"{r['policy']:>7}: key {r['keys']['ms_per_key_p50']} ms, "
            f"budgets {r['budgets']['requests_per_s']} req/s "
            f"(reserve p50 {r['budgets']['reserve_ms_p50']} ms), "
            f"batch {r['batch']['lines_per_s']} lines/s, files {r['files']['mib_per_s']} MiB/s"
        )
    return 0

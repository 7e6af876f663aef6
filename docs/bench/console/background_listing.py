"""How long a page of the console's background-response listing takes to make (docs/console.md,
"What it does not do yet"): the index read whole for an admin, one owner's keys only.

    PYTHONPATH=. .venv/bin/python docs/bench/console/background_listing.py [--owners 100]
        [--runs 5]

Starts a nats-server (JetStream), fills the index (jobs/background_index.py) to its bound
(``MAX_ENTRIES`` entries, spread over ``--owners`` owners), then times
``BackgroundIndex.page`` for an admin (every entry), one owner and an owner of two keys,
``--runs`` times each. Prints ms per page and the load average. Not a test: nothing asserts
on these times (STYLE.md, 11).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
import uuid

import nats

from jobs.background_index import MAX_ENTRIES, ORDER, BackgroundIndex
from tokenbus.launcher import free_port, nats_server_binary, port_open


async def bench(port: int, owners: int, runs: int) -> None:
    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    index = await BackgroundIndex(nc, 86400.0).open()
    assert index.kv is not None
    who = [uuid.uuid4().hex[:12] for _ in range(owners)]
    now = time.time()
    puts = []
    for i in range(MAX_ENTRIES):
        rid, owner = f"resp_{uuid.uuid4().hex}", who[i % owners]
        entry = {"id": rid, "owner": owner, "created_at": int(now) - i, "status": "completed",
                 "model": "tokenbus-sim", "output_tokens": 100, ORDER: now - i}  # fmt: skip
        puts.append(index.kv.put(index.key(owner, rid), json.dumps(entry).encode()))
        if len(puts) >= 500:
            await asyncio.gather(*puts)
            puts = []
    await asyncio.gather(*puts)
    for label, scope in (("admin", None), ("one owner", who[:1]), ("two keys", who[:2])):
        took = []
        for _ in range(runs):
            t0 = time.perf_counter()
            listed = await index.newest_first(scope)
            page = listed[:50]
            took.append(round((time.perf_counter() - t0) * 1000, 1))
        print(f"{label}: {len(listed)} entries, a page of {len(page)} in ms {sorted(took)}")
    print(f"load average {os.getloadavg()}")
    await nc.close()


def main(owners: int, runs: int) -> None:
    port = free_port()
    store = tempfile.mkdtemp(prefix="bg-listing-")
    server = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.05)
        asyncio.run(bench(port, owners, runs))
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--owners", type=int, default=100)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    main(a.owners, a.runs)

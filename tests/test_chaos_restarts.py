"""Chaos, the planned stops: a worker drained (SIGTERM) and the NATS server restarted under
steady load (64 concurrent clients) on the locked bus; kills: tests/test_chaos.py and
tests/test_chaos_stages.py."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from bus_schemas import errors as E
from tests.lockedbus import LockedBus
from tests.support.procs import Procs
from tests.support.waits import wait_for
from tests.test_chaos import (
    CLIENTS,
    Tally,
    _start_stack,
    bus,
    served_on,
    steady_load,
    under_way,
)
from tokenbus import Client

pytestmark = pytest.mark.fault

# The locked bus of each test's own (a fixture of tests/test_chaos.py).
__all__ = ["bus"]


async def test_draining_a_worker_under_load_loses_no_request(
    bus: LockedBus, model: str, tmp_path: Path
) -> None:
    with Procs(bus.url, tmp_path) as procs:
        stack, key = await _start_stack(procs, bus, model, '["auth", "route"]')
        tally = Tally()
        async with await Client.connect(bus.url, api_key=key) as client:
            load = asyncio.create_task(steady_load(client, model, 3.0, tally))
            await under_way(load, tally)
            stack.workers[0].signal(signal.SIGTERM)
            before = await served_on(load, tally)
        assert stack.workers[0].proc.wait(20) == 0
    tally.report("SIGTERM worker")
    # Served on while it drained (not a throughput: see the kill -9 test), nothing failed.
    assert tally.outcomes["ok"] - before >= CLIENTS // 4, (before, tally.outcomes)
    assert tally.failed() == 0, tally.outcomes


async def test_nats_server_restart_under_load(bus: LockedBus, model: str, tmp_path: Path) -> None:
    with Procs(bus.url, tmp_path) as procs:
        _, key = await _start_stack(procs, bus, model, '["auth", "route"]')
        tally = Tally()
        c = await Client.connect(bus.url, api_key=key, reconnect_time_wait=0.2)
        try:
            load = asyncio.create_task(steady_load(c, model, 6.0, tally))
            await under_way(load, tally)
            bus.stop()
            # The outage itself, the fault under test: a fixed span, not a wait for anything.
            await asyncio.sleep(1.0)
            # Timed from here: the first success after the server is back (reported; how
            # soon is the chaos benchmark's figure, not this test's bound). The load runs on
            # until that success, bounded, and a second more.
            tally.event_at = time.monotonic()
            tally.stop_at = tally.event_at + 60
            bus.start()  # the same config and port; the key store kept in its store_dir
            await wait_for(
                lambda: tally.first_ok_after is not None or load.done(),
                timeout=60,
                what="no request was served after the restart",
            )
            tally.stop_at = time.monotonic() + 1.0
            await load
        finally:
            await c.close()
        tally.report("nats-server restart (down 1 s)")
        # In-flight requests end with a retryable error (none hangs, none is wrong); new
        # ones succeed as soon as the server is back and the services (auth first: the
        # client's own login waits for its callout) have reconnected.
        assert tally.outcomes["hung"] == 0 and tally.outcomes["wrong_text"] == 0, tally.outcomes
        failed = {k: v for k, v in tally.outcomes.items() if k != "ok"}
        assert all(
            E.ERRORS_BY_CODE.get(k) is not None and E.ERRORS_BY_CODE[k].retryable for k in failed
        ), (failed, tally.errors[:5])
        assert tally.first_ok_after is not None, tally.outcomes
        assert procs.all_alive()

"""Stalls of a JetStream stream's leader in a 3-node cluster: paused, or cut off from its
peers only; every write goes through once, under one leader, and the nodes' replicas agree
afterwards (docs/fault-tolerance.md, "Stalls"). A node under a stack: tests/test_stalls_nodes.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import nats
import pytest

from auth import budgets
from auth.store import KeyStore
from bus_schemas import errors as E
from services import buckets
from services.natsconf import role_login
from tests import netns
from tests.lockedbus import LockedCluster
from tests.support.waits import wait_for
from tests.test_stalls import pause


def _replicas_agree(cluster: LockedCluster, stream: str) -> bool:
    """Whether every node's own replica of ``stream`` has the same messages and sequences."""
    keys = ("messages", "first_seq", "last_seq")
    states = [cluster.stream_state(i, stream) for i in range(len(cluster.ports))]
    return all(st and [st[k] for k in keys] == [states[0][k] for k in keys] for st in states)


@pytest.mark.fault
async def test_spend_and_keys_hold_exact_through_a_paused_stream_leader(
    tmp_path: Path, paused: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node that leads the spend book's stream (R3) paused while budgets are held and
    settled and keys are made through another node: every write goes through once a new
    leader is elected, none is applied twice (a settle whose answer was lost in the stall
    is not charged again), and after the pause the paused node's replica catches up with
    the same stream (no divergence)."""
    monkeypatch.setenv("TOKENBUS_KV_REPLICAS", "3")
    cluster = LockedCluster(tmp_path / "cluster").start()
    try:
        await cluster.routed()
        await cluster.create_key("before")  # the key store, R3
        probe = await cluster.admin(0)
        book = await budgets.SpendBook(probe).open()
        info = await probe.jetstream().stream_info(f"KV_{budgets.BUCKET}")
        await probe.close()
        assert info.cluster is not None and info.cluster.leader is not None
        leader = int(info.cluster.leader.removeprefix("node"))
        other = (leader + 1) % 3
        nc = await cluster.admin(other)
        try:
            book = await budgets.SpendBook(nc).open()
            keys = await KeyStore(nc).open(watch=False)
            b = budgets.Budget("k.stall", "total", None, None)

            async def spend(i: int) -> None:
                hold = await book.reserve([b], f"r{i}", 100, time.time() + 60)
                await book.settle(hold, 7)

            await spend(0)
            pause(paused, cluster.procs[leader].pid)
            made = await asyncio.gather(*(keys.create(f"k{i}") for i in range(3)))
            await asyncio.gather(*(spend(i) for i in range(1, 21)))
            os.kill(cluster.procs[leader].pid, signal.SIGCONT)
            assert await book.spent(b) == (21 * 7, 0)
        finally:
            await nc.close()
        # The paused node's own replicas catch up: the same messages as the others'.
        for stream in (f"KV_{budgets.BUCKET}", "KV_tokenbus_keys"):
            await wait_for(
                lambda stream=stream: _replicas_agree(cluster, stream),
                timeout=30,
                what=f"the nodes' replicas of {stream} did not agree",
            )
        # Read through the node that was paused: every key made meanwhile is there.
        back = await cluster.admin(leader)
        try:
            store = await KeyStore(back).open()
            for key, _ in made:
                assert store.lookup(key).name.startswith("k")
            assert await budgets.SpendBook(back).open() is not None
        finally:
            await back.close()
    finally:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        cluster.stop()


@pytest.mark.fault
async def test_a_leader_cut_off_from_its_peers_takes_no_write_and_leaves_no_split_brain(
    hosts: netns.Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three NATS nodes on hosts of their own; the node that leads the spend book's stream
    is cut off from its two peers only (it still has its clients): a write through it is
    not acknowledged (a clear, retryable error), writes through the majority go on under a
    new leader, and once the cut heals every node holds the same stream (no split brain),
    with exactly the majority's writes."""
    monkeypatch.setenv("TOKENBUS_KV_REPLICAS", "3")
    nodes = [hosts.add(f"n{i}") for i in range(3)]
    cluster = LockedCluster(tmp_path / "cluster", hosts=nodes).start()
    stream = f"KV_{budgets.BUCKET}"
    try:
        await cluster.routed()
        probe = await cluster.admin(0)
        book = await budgets.SpendBook(probe).open()
        b = budgets.Budget("k.cut", "total", None, None)
        await book.settle(await book.reserve([b], "r0", 100, time.time() + 60), 7)
        info = await probe.jetstream().stream_info(stream)
        await probe.close()
        assert info.cluster is not None and info.cluster.leader is not None
        leader = int(info.cluster.leader.removeprefix("node"))
        peers = [i for i in range(3) if i != leader]
        lone = await nats.connect(cluster.url(leader), **role_login(cluster.users, "admin"))
        major = await cluster.admin(peers[0])
        try:
            kv = await lone.jetstream(timeout=1).key_value(budgets.BUCKET)
            book = await budgets.SpendBook(major).open()  # a service's, opened before
            for p in peers:
                hosts.isolate(nodes[leader], nodes[p])
            # Through the cut-off node: never acknowledged.

            def add(state: dict[str, Any]) -> dict[str, Any]:
                return {**state, "spent": int(state.get("spent", 0)) + 1000}

            with pytest.raises(E.ServiceUnavailable) as refused:
                await buckets.cas(kv, b.entry(), add, stall_s=3)
            print(f"\na write through the cut-off leader: {refused.value!r}"[:200])
            # Through the majority: every write goes through (a new leader).
            for i in range(1, 11):
                await book.settle(await book.reserve([b], f"r{i}", 100, time.time() + 60), 7)
            for p in peers:
                hosts.rejoin(nodes[leader], nodes[p])

            await wait_for(
                lambda: _replicas_agree(cluster, stream),
                timeout=30,
                what="the nodes' replicas did not agree",
            )
            assert await book.spent(b) == (11 * 7, 0)
        finally:
            await lone.close()
            await major.close()
        # Read through the node that was cut off: the majority's history, not its own.
        back = await cluster.admin(leader)
        try:
            assert await (await budgets.SpendBook(back).open()).spent(b) == (11 * 7, 0)
        finally:
            await back.close()
    finally:
        cluster.stop()

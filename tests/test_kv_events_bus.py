"""KV-cache events on a real nats-server: a sim worker publishes what its prefix cache stores
and evicts, numbered without gaps, answers snapshot requests, and reads a repeated prompt
from its cache; on the locked bus only routers and bridges may follow or ask."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import codec, subjects
from bus_schemas import kv_events as K
from engine_worker.backends.base import GenerationRequest
from services.natsconf import generate, role_env, role_login
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer, spawn_nats
from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.waits import wait_for
from tokenbus import Client

pytestmark = pytest.mark.stack

BS = 4
SIM = {"kv_cache_blocks": 64, "block_size": BS, "prefill_ms": 1.0, "decode_ms": 1.0}
FIRST = [{"role": "user", "content": "kv " * 40}]  # 129 characters: 33 tokens, 8 full blocks
LONGER = [*FIRST, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]


def prompt_of(messages: list[dict[str, Any]]) -> str:
    """The prompt text the sim renders (and tokenises) for ``messages``."""
    return GenerationRequest("r", "chat", "m", 1, messages=messages).prompt_text()


def hashes_of(messages: list[dict[str, Any]]) -> list[int]:
    return K.text_block_hashes(prompt_of(messages), BS)


class Follower:
    """What a router keeps of one model's KV events: every batch, checked, in order of
    arrival, applied to its copy of each replica's blocks."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.blocks: dict[str, dict[Any, Any]] = {}
        self.last: dict[str, int] = {}

    async def on_msg(self, msg: Msg) -> None:
        b = K.decode_batch(msg.data)
        self.batches.append(b)
        blocks = self.blocks.setdefault(b["replica"], {})
        for ev in b["events"]:
            K.apply_event(blocks, ev)
        self.last[b["replica"]] = b["seq_last"]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [ev for b in self.batches for ev in b["events"] if kind in (None, ev["type"])]

    def numbers(self) -> list[int]:
        return [n for b in self.batches for n in range(b["seq_first"], b["seq_last"] + 1)]

    def match(self, replica: str, hashes: list[int]) -> int:
        blocks, n = self.blocks.get(replica, {}), 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        return n


async def follow(nc: NATS, model: str) -> Follower:
    f = Follower()
    await nc.subscribe(subjects.kv_events_wildcard(model), cb=f.on_msg)
    await nc.flush()
    return f


async def snapshot(nc: NATS, model: str, replica: str) -> dict[str, Any]:
    msg = await nc.request(subjects.kv_snapshot(model, replica), b"", timeout=10)
    page = K.decode_snapshot(msg.data)
    assert page["pages"] == 1
    return page


async def test_a_worker_publishes_its_cache_and_a_repeated_prompt_hits_it(
    nats_server: NatsServer, model: str, client: Client, nc: NATS
) -> None:
    f = await follow(nc, model)
    async with stack(nats_server.url, model, workers=1, worker={"sim": SIM}) as svcs:
        replica = svcs["workers"][0].replica
        hs = hashes_of(FIRST)
        assert len(hs) == 8
        out = await client.chat_completion(model, FIRST, max_tokens=3)
        assert out.replica == replica
        await wait_for(lambda: f.last.get(replica) == 1, what="no stored event")
        (batch,) = f.batches
        assert (batch["replica"], batch["model"], batch["block_size"]) == (replica, model, BS)
        assert batch["events"] == [K.stored(hs, None, BS)]
        snap = await snapshot(nc, model, replica)
        assert snap["seq"] == 1 and snap["capacity_blocks"] == 64
        assert dict(snap["blocks"]) == f.blocks[replica]
        assert (snap["stats"]["query_tokens"], snap["stats"]["hit_tokens"]) == (33, 0)

        # The same prompt again: 32 of its 33 tokens come from the cache (the last one is
        # always computed), so only one is prefilled; nothing new is stored.
        await client.chat_completion(model, FIRST, max_tokens=3)
        snap = await snapshot(nc, model, replica)
        assert snap["seq"] == 1
        assert (snap["stats"]["query_tokens"], snap["stats"]["hit_tokens"]) == (66, 32)

        # A next turn repeats the first prompt and goes on: its new blocks are stored after
        # the cached ones, with consecutive numbers.
        longer = hashes_of(LONGER)
        assert longer[:8] == hs
        await client.chat_completion(model, LONGER, max_tokens=3)
        await wait_for(lambda: f.last.get(replica) == 2, what="no second stored event")
        assert f.events()[1] == K.stored(longer[8:], hs[7], BS)
        assert f.numbers() == [1, 2]
        assert f.match(replica, longer) == len(longer)
        snap = await snapshot(nc, model, replica)
        assert snap["seq"] == 2 and snap["stats"]["hit_tokens"] == 64
        assert dict(snap["blocks"]) == f.blocks[replica]


async def test_evictions_reach_routers_so_their_lookups_match_the_replicas(
    nats_server: NatsServer, model: str, client: Client, nc: NATS
) -> None:
    f = await follow(nc, model)
    sim = {**SIM, "kv_cache_blocks": 12}
    async with stack(nats_server.url, model, workers=1, worker={"sim": sim}) as svcs:
        w = svcs["workers"][0]
        cache = w.backend.engine.cache
        prompts = [[{"role": "user", "content": f"{i} " * 60}] for i in range(4)]
        for messages in prompts:
            await client.chat_completion(model, messages, max_tokens=3)
        await wait_for(lambda: f.last.get(w.replica) == cache.seq, what="events missing")
        assert f.numbers() == list(range(1, cache.seq + 1))
        assert f.events(K.REMOVED), "a cache of 12 blocks must have evicted"
        seq, blocks = cache.snapshot()
        assert dict(blocks) == f.blocks[w.replica]
        found = [f.match(w.replica, hashes_of(m)) for m in prompts]
        assert found == [cache.match(hashes_of(m)) for m in prompts]
        assert found[0] == 0 and found[-1] > 0
        snap = await snapshot(nc, model, w.replica)
        assert snap["seq"] == seq and dict(snap["blocks"]) == dict(blocks)


async def test_on_the_locked_bus_routers_follow_a_worker_process_and_clients_cannot(
    tmp_path: Path,
) -> None:
    port = free_port()
    conf, users = generate(tmp_path / "locked", port=port)
    server = spawn_nats(port, "-c", str(conf))
    url = f"nats://127.0.0.1:{port}"
    model = "kv-locked"
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    try:
        with Procs(url, tmp_path) as procs:
            # Real processes, each logged in as its role; the worker's flags set its cache.
            stack_ = await start_stack(
                procs,
                model,
                "ingress",
                "router",
                bridge=False,
                worker_args=["--sim-kv-cache-blocks", "32", "--sim-block-size", str(BS)],
                env_for=lambda role, _: role_env(users, role),
                login=role_login(users, "admin"),
            )
            router = await nats.connect(url, **role_login(users, "router"))
            bridge = await nats.connect(url, **role_login(users, "bridge"))
            spy = await nats.connect(url, error_cb=on_error, **role_login(users, "client"))
            try:
                f = await follow(router, model)
                seen_by_bridge = await follow(bridge, model)
                await spy.subscribe(subjects.kv_events_wildcard(), cb=_ignore)
                replica = f"{model}-0"
                login = role_login(users, "client")
                async with await Client.connect(
                    url, user=login["user"], password=login["password"]
                ) as c:
                    await c.chat_completion(model, FIRST, max_tokens=3)
                await wait_for(lambda: f.last.get(replica) == 1, what="no stored event")
                assert f.events() == [K.stored(hashes_of(FIRST), None, BS)]
                snap = await snapshot(router, model, replica)
                assert snap["capacity_blocks"] == 32 and snap["seq"] == 1
                assert (await snapshot(bridge, model, replica))["blocks"] == snap["blocks"]
                await wait_for(lambda: seen_by_bridge.last.get(replica) == 1)
                # A client may neither read the events nor ask a replica for its cache.
                await spy.publish(subjects.kv_snapshot(model, replica), codec.encode({}))
                await spy.flush()
                await wait_for(
                    lambda: sum("permissions violation" in e.lower() for e in errors) >= 2,
                    what="a client was let near the KV events",
                )
                # A worker that stops says its cache is gone: the next number, all cleared.
                (worker,) = stack_.workers
                assert await asyncio.to_thread(worker.stop) == 0
                await wait_for(lambda: f.last.get(replica) == 2, what="no all_cleared")
                assert f.events()[-1] == K.all_cleared() and f.blocks[replica] == {}
                assert "Permissions Violation" not in worker.output()
            finally:
                for conn in (router, bridge, spy):
                    await conn.close()
    finally:
        server.terminate()
        server.wait(10)


async def _ignore(msg: Msg) -> None:
    return None
